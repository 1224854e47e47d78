"""One launch of a Hopper attention kernel for Nsight Compute to profile (8k causal prefill or B=64 x 4k decode,
llama-3.1-8b heads, pages of 16, bf16 or an 8-bit cache): the launch it reads is the second, after the build.

    ncu --clock-control none --kernel-name regex:_prefill_sm90 --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --print-details all python3 dev/ncu_attention.py prefill int8
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_kernels import paged_cache, quantized_cache  # noqa: E402
from minfer.kernels.attention.decode_attention_sm90 import paged_decode_attention_sm90  # noqa: E402
from minfer.kernels.attention.prefill_attention_sm90 import paged_prefill_attention_sm90  # noqa: E402

kernel, kv_dtype = sys.argv[1], sys.argv[2]
hq, hkv, d = 32, 8, 128
t = 8192
lens_list = [t] if kernel == "prefill" else [4096] * 64
kc, vc, table, lens = paged_cache(lens_list, hkv, d, 16)
sc = {}
if kv_dtype != "auto":
    kc, vc, ks, vs = quantized_cache(kc, vc, kv_dtype)
    sc = dict(k_scale=ks, v_scale=vs)
for _ in range(2):
    if kernel == "prefill":
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        paged_prefill_attention_sm90(q, kc, vc, table, qsl, lens, t, d ** -0.5, **sc)
    else:
        q = torch.randn(len(lens_list), hq, d, device="cuda", dtype=torch.bfloat16)
        paged_decode_attention_sm90(q, kc, vc, table, lens, d ** -0.5, **sc)
torch.cuda.synchronize()
