#!/usr/bin/env bash
# Launch-config tuning runs on one H200 (issue 5), each in its own process, logs under $OUT:
#   1. decode attention over workload A's real context mixes, per split count (bench_decode_splits.py)
#   2. batch-1 decode on llama-3.2-1b per gemv / split variant (batch1_sweep.py)
#   3. workload A on qwen3-0.6b under split-heuristic variants "ENOUGH_PER_SM/SPLIT_TARGET_PER_SM" ($SPLIT_VARIANTS)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } | tee "$OUT/gpu.txt"
if [ "${SKIP_SPLITS:-0}" != 1 ]; then
  echo "== decode splits, qwen3-0.6b heads"
  timeout 120 python3 benchmarks/bench_decode_splits.py --heads 16/8/128 2>&1 | tee "$OUT/decode_splits_qwen3.md"
fi
for v in ${BATCH1_VARIANTS:-}; do
  timeout 90 python3 benchmarks/batch1_sweep.py --variants "$v" 2>&1 | grep -E "^\||Error|error" | tee -a "$OUT/batch1.md"
done
for v in ${SPLIT_VARIANTS:-}; do
  echo "== workload A qwen3-0.6b, split heuristic $v"
  timeout 150 python3 -c "
import sys
import minfer.kernels.decode_attention as d
d.ENOUGH_PER_SM, d.SPLIT_TARGET_PER_SM = (int(x) for x in sys.argv[1].split('/'))
from minfer.cli import main
sys.exit(main(sys.argv[2:]))" "$v" -v bench --quiet --shape qwen3-0.6b --output-json "$OUT/qwen3_split_${v/\//_}.json" \
    > "$OUT/qwen3_split_${v/\//_}.log" 2>&1 || echo "exit $?"
  grep -E "output tok/s|Error" "$OUT/qwen3_split_${v/\//_}.log" | head -3
done
