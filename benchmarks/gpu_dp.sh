#!/usr/bin/env bash
# Data parallelism against tensor parallelism (issues 41 and 43) on llama-3.1-8b, on 2 H200s (one for ONE), in one
# command that ends within ~9.5 minutes (DEADLINE seconds); not run yet (it waits for a kind with two GPUs):
#
#   bash benchmarks/gpu_dp.sh                       # needs the server's wheels: fetch_server_wheels.sh, carry .whl
#   RUNS="dp2 tp2" SERVE_CONC=64,256 bash benchmarks/gpu_dp.sh
#
# Each run is `minfer bench-serve --launch` on the 8B shape with random weights drawn on the GPUs (--load-format
# dummy: only config.json is written), closed loop at SERVE_CONC clients (default 1,16,64,256), fixed 512 in / 128 out
# (SERVE_WORKLOAD), the same prompts for every run:
#   one:  one GPU                              (--tensor-parallel-size 1)
#   tp2:  one engine sharded over two GPUs     (--tensor-parallel-size 2)
#   dp2:  two replicas, one GPU each, behind the balancer (--data-parallel-size 2)
# -> $OUT/serve_<run>/results.json, and $OUT/gpu_dp.md: output tok/s, TTFT and TPOT p50/p99 per run and level, with
# dp2's requests per replica (the balancer's split). A run that needs more GPUs than `nvidia-smi -L` lists (NGPUS
# overrides) is skipped, saying so. ENGINE_ARGS is added to every server (e.g. "--max-num-seqs 128"). A CPU dry run:
#   NGPUS=2 MODEL_8B=<a small checkpoint> MAX_LEN=256 SERVE_CONC=4 ENGINE_ARGS="--num-kv-blocks 64" \
#   SERVE_WORKLOAD="--workload fixed --input-len 16 --output-len 8 --num-prompts 8 --token-id-max 200" bash ...
PY="${PYTHON:-python3}"
source "$(dirname "$0")/device_call.sh"
RUNS="${RUNS:-one tp2 dp2}"
SERVE_CONC="${SERVE_CONC:-1,16,64,256}"
SERVE_WORKLOAD="${SERVE_WORKLOAD:---workload fixed --input-len 512 --output-len 128}"
ENGINE_ARGS="${ENGINE_ARGS:-}"
MAX_LEN="${MAX_LEN:-4096}"
if [ -n "${MODEL_8B:-}" ]; then M8=(--model "$MODEL_8B"); else M8=(--shape llama-3.1-8b --load-format dummy); fi
NGPUS="${NGPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo "no GPU"; date -u
  git log -1 --format=%h 2>/dev/null; echo "GPUs: $NGPUS; runs: $RUNS; clients: $SERVE_CONC"; } | tee "$OUT/gpu.txt"
: > "$OUT/notes.txt"
note() { echo "$*" | tee -a "$OUT/notes.txt"; }

port=8051
for run in $RUNS; do
  case "$run" in
    one) flags=(--tensor-parallel-size 1); gpus=1 ;;
    tp2) flags=(--tensor-parallel-size 2); gpus=2 ;;
    dp2) flags=(--data-parallel-size 2); gpus=2 ;;
    *) note "unknown run $run (one, tp2, dp2)"; continue ;;
  esac
  if [ "$gpus" -gt "$NGPUS" ]; then note "skipped: $run needs $gpus GPUs; $NGPUS visible"; continue; fi
  echo "== $run ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 270)" "$PY" -m minfer.cli -v bench-serve --launch "${M8[@]}" \
    --max-model-len "$MAX_LEN" --port "$port" "${flags[@]}" --concurrency "$SERVE_CONC" $SERVE_WORKLOAD \
    --output-dir "$OUT/serve_$run" $ENGINE_ARGS > "$OUT/serve_$run.log" 2>&1 \
    || note "$run: exit $? (124: cut by the time limit)"
  tail -7 "$OUT/serve_$run.log"
  port=$(( port + 1 ))
done

"$PY" - "$OUT" <<'PY' | tee "$OUT/gpu_dp.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print((out / "gpu.txt").read_text().strip().replace("\n", "; ") + "\n")
print("| run | clients | output tok/s | vs one | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed |")
print("|---|---:|---:|---:|---:|---:|---:|")
base = {}
for run in ("one", "tp2", "dp2"):
    path = out / f"serve_{run}" / "results.json"
    if not path.is_file():
        continue
    report = json.loads(path.read_text())
    for level in report["levels"]:
        c, tok = level.get("concurrency"), level["output_tok_s"]
        base.setdefault(c, tok if run == "one" else None)
        ratio = f"{tok / base[c]:.2f}x" if base.get(c) else "-"
        ttft, tpot = level["ttft_ms"], level["tpot_ms"]
        print(f"| {run} | {c} | {tok:,.0f} | {ratio} | {ttft['p50']:.0f} / {ttft['p99']:.0f} "
              f"| {tpot['p50']:.1f} / {tpot['p99']:.1f} | {level['failed']} |")
    replicas = report.get("engine_stats_after", {}).get("replicas")
    if replicas:
        print(f"\n{run}: requests per replica {[r['routed'] for r in replicas]}\n")
PY
cat "$OUT/notes.txt"
echo "done after $(( SECONDS - START )) s"
