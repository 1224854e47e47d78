#!/usr/bin/env bash
# Engine throughput on one H200 (issue 5), in one command that ends within ~9 minutes:
#
#   bash benchmarks/gpu_engine.sh        # logs, JSON and a summary table under $OUT (default /tmp/minfer-out)
#
# 1. The engine's and kernels' gpu tests (HF agreement, graphs == eager, async == sync scheduling).
# 2. Workload A (BENCHMARKS.md) on qwen3-0.6b, with and without async scheduling, and on llama-3.2-1b.
# 3. Batch-1 decode on llama-3.2-1b (with and without PDL); HF transformers' generate_batch on a subset, same process
#    (SKIP_HF=1 leaves that out; SKIP_SYNC=1 the sync-scheduling run).
# The llama-3.1-8b runs (16 GB checkpoint) are in benchmarks/gpu_8b.sh; profiles of the steps in dev/gpu_profiles.sh.
DEADLINE_DEFAULT=540
source "$(dirname "$0")/device_call.sh"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git rev-parse --short HEAD; } | tee "$OUT/gpu.txt"
bench() {  # name, then minfer bench arguments
  local name=$1; shift
  echo "== $name ($(left) s left)"
  timeout "$(cap 150)" python3 -m minfer.cli -v bench --quiet --output-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 \
    || echo "   exit $? (124: cut by the time limit)"
  grep -E "output tok/s|bound|preempt|peak|HF|Error" "$OUT/$name.log" | head -8
}

echo "== gpu tests ($(left) s left)"
timeout "$(cap 150)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_engine_gpu.py tests/kernels 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
bench workload_a_qwen3-0.6b --shape qwen3-0.6b
[ "${SKIP_SYNC:-0}" = 1 ] || bench workload_a_qwen3-0.6b_sync --shape qwen3-0.6b --no-async-scheduling
bench workload_a_llama-3.2-1b --shape llama-3.2-1b
bench batch1_llama-3.2-1b --shape llama-3.2-1b --batch1
MINFER_PDL=0 bench batch1_llama-3.2-1b_no_pdl --shape llama-3.2-1b --batch1   # programmatic dependent launch off
[ "${SKIP_HF:-0}" = 1 ] || bench compare_hf_qwen3-0.6b --shape qwen3-0.6b --compare-hf

python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lines = ["| run | output tok/s | total tok/s | wall s | share of bound | preemptions | note |", "|---|---|---|---|---|---|---|"]
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    if "batch1" in r:
        b = r["batch1"]
        lines.append(f"| {f.stem} | {b['decode_tok_s']:,.0f} | | | {100 * b['share_of_bound']:.1f}% of {b['bound_tok_s']:,.0f} | | "
                     f"TTFT {1e3 * b['ttft_s']:.1f} ms |")
        continue
    note = ""
    if "compare_hf" in r:
        c = r["compare_hf"]
        note = (f"same {c['requests']} requests x {c['output_len']} tokens: minfer {c['minfer_output_tok_s']:,.0f}, "
                f"HF generate_batch {c['hf_output_tok_s']:,.0f} tok/s = {c['speedup']:.1f}x")
    lines.append(f"| {f.stem} | {r['output_tok_s']:,.0f} | {r['total_tok_s']:,.0f} | {r['seconds']:.1f} "
                 f"| {100 * r.get('share_of_bound', 0):.1f}% | {r['num_preemptions']} | {note} |")
(out / "engine.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "done in $(( SECONDS - START )) s"
