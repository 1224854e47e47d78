"""Launches of the batch-1 matrix-vector kernel for Nsight Compute: llama-3.1-8b's gate_up (28672 x 4096, the RMS
prologue), bf16 and e4m3 with per-row scales: the shape where the FP8 kernel runs furthest from the bandwidth
(RESULTS.md). Each format launches three times (build, warm, measured), so the third launch is bf16's measured one
and the sixth e4m3's; the command below profiles the third to the sixth.

    ncu --clock-control none --kernel-name regex:_gemv_kernel --launch-skip 2 --launch-count 4 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --print-details all python3 dev/ncu_gemv.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from minfer.kernels.gemm.gemv import gemv_rms_norm  # noqa: E402
from minfer.kernels.quant.fp8_ref import quantize_fp8_ref  # noqa: E402

n, k = 28672, 4096
dev, dt = "cuda", torch.bfloat16
w = torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5
x, res = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
nw = torch.ones(k, device=dev, dtype=dt)
codes, scale = quantize_fp8_ref(w, None)
for weight, weight_scale in ((w, None), (codes, scale)):
    for _ in range(3):
        gemv_rms_norm(x, res, nw, 1e-5, weight, None, weight_scale=weight_scale)
torch.cuda.synchronize()
