#!/usr/bin/env bash
# Decode CUDA graphs + fused sampler: gpu tests, workload A (qwen3-0.6b), decode-step profile.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/kernels/test_kernel_sampling.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
python3 -m minfer.cli -v bench --shape qwen3-0.6b --quiet --output-json "$OUT/workload_a_qwen3-0.6b_graphs.json" 2>&1 | grep -E "tok_s|seconds|share|preempt|KV cache|captured|peak"
python3 benchmarks/profile_steps.py --shape qwen3-0.6b --out "$OUT/profile_qwen3-0.6b_graphs.txt" 2>&1 | grep -v Warn | head -22
