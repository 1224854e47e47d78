#!/usr/bin/env bash
# One GPU session: gpu-marked tests, then workload A (qwen3-0.6b) on the Triton path and a short
# torch.profiler trace of decode steps. Writes logs and JSON under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
python3 -m minfer.cli -v bench --shape qwen3-0.6b --quiet --output-json "$OUT/workload_a_qwen3-0.6b_triton.json" 2>&1 | tail -30
python3 benchmarks/profile_steps.py --shape qwen3-0.6b --out "$OUT/profile_qwen3-0.6b.txt" 2>&1 | tail -45
