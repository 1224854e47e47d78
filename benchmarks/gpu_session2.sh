#!/usr/bin/env bash
# Engine GPU tests, then workload A on the llama-3.2-1b shape (Triton path).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
python3 -m minfer.cli -v bench --shape llama-3.2-1b --quiet --output-json "$OUT/workload_a_llama-3.2-1b_triton.json" 2>&1 | grep -E "tok_s|seconds|share|preempt|KV cache|peak"
