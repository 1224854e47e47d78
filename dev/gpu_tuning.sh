#!/usr/bin/env bash
# Launch-config tuning runs on one H200 (issue 5), each in its own process, logs under $OUT:
#   1. decode attention over workload A's real context mixes ($MIXES), per split count (bench_decode_splits.py)
#   2. batch-1 decode on llama-3.2-1b per split variant, "name" or "name@input_len" ($BATCH1_VARIANTS, batch1_sweep.py)
#   3. workload A on qwen3-0.6b under split-heuristic variants "ENOUGH_PER_SM/SPLIT_TARGET_PER_SM" ($SPLIT_VARIANTS)
#   4. workload A on qwen3-0.6b with the bf16 decode kernel's config "BLOCK_N/WARPS/STAGES" or "default" ($DECODE_CONFIGS)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } | tee "$OUT/gpu.txt"
if [ "${SKIP_SPLITS:-0}" != 1 ]; then
  echo "== decode splits, qwen3-0.6b heads"
  timeout 200 python3 benchmarks/bench_decode_splits.py --heads 16/8/128 --mixes "${MIXES:-as-is}" \
    --batches "${BATCHES:-256,192,128,96,64,48,32,16}" --splits "${SPLITS:-1,2,3,4,6,8}" \
    --configs "${CONFIGS:-default}" 2>&1 \
    | tee "$OUT/decode_splits_qwen3.md"
fi
for v in ${BATCH1_VARIANTS:-}; do   # name or name@input_len
  timeout 90 python3 dev/batch1_sweep.py --variants "${v%@*}" --input-len "$( [ "${v#*@}" != "$v" ] && echo "${v#*@}" || echo 128)" \
    2>&1 | grep -E "^\||Error|error" | sed "s/^| ${v%@*} |/| $v |/" | tee -a "$OUT/batch1.md"
done
for v in ${SPLIT_VARIANTS:-}; do
  echo "== workload A qwen3-0.6b, split heuristic $v"
  timeout 150 python3 -c "
import sys
import minfer.kernels.attention.decode_attention as d
d.ENOUGH_PER_SM, d.SPLIT_TARGET_PER_SM = (int(x) for x in sys.argv[1].split('/'))
from minfer.cli import main
sys.exit(main(sys.argv[2:]))" "$v" -v bench --quiet --shape qwen3-0.6b --output-json "$OUT/qwen3_split_${v/\//_}.json" \
    > "$OUT/qwen3_split_${v/\//_}.log" 2>&1 || echo "exit $?"
  grep -E "output tok/s|Error" "$OUT/qwen3_split_${v/\//_}.log" | head -3
done
for v in ${DECODE_CONFIGS:-}; do
  echo "== workload A qwen3-0.6b, decode config $v"
  timeout 150 python3 -c "
import sys
import minfer.kernels.attention.decode_attention as d
if sys.argv[1] != 'default':
    base, cfg = d.default_config, d.DecodeConfig(*(int(x) for x in sys.argv[1].split('/')))
    d.default_config = lambda device, head_dim, dtype, cache_dtype=None: cfg if cache_dtype is None else base(
        device, head_dim, dtype, cache_dtype)
from minfer.cli import main
sys.exit(main(sys.argv[2:]))" "$v" -v bench --quiet --shape qwen3-0.6b --output-json "$OUT/qwen3_decode_${v//\//_}.json" \
    > "$OUT/qwen3_decode_${v//\//_}.log" 2>&1 || echo "exit $?"
  grep -E "output tok/s|Error" "$OUT/qwen3_decode_${v//\//_}.log" | head -3
done
for f in "$OUT"/qwen3_*.json; do
  [ -f "$f" ] && python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(f\"| {sys.argv[1].rsplit('/', 1)[1][:-5]} | {r['output_tok_s']:,.0f} tok/s | {r['seconds']:.2f} s |\")" "$f"
done
