#!/usr/bin/env bash
# Core-engine GPU run (issue 2): workload A on the qwen3-0.6b shape, bfloat16, torch attention path.
# Usage on the GPU machine, from the repo root:  bash benchmarks/core_gpu.sh  (writes under $OUT or /tmp)
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -m minfer.cli -v bench --shape qwen3-0.6b --attention-backend torch --output-json "$OUT/core_workload_a_qwen3-0.6b.json" 2>&1 | tee "$OUT/core_bench.log"
