#!/usr/bin/env bash
# Data parallelism against tensor parallelism (issues 41 and 43), in one command that ends within ~9.5 minutes
# (DEADLINE seconds); not run yet (it waits for a kind with two or four GPUs). Three calls on nvidia-h200-x2 cover
# issue 43's two-GPU runs, one on nvidia-h200-x4 its 70B runs:
#
#   RUNS="A-one A-dp2 A-tp2" bash benchmarks/gpu_dp.sh          # workload A offline (minfer bench), 8B
#   RUNS="one dp2 tp2" SERVE_CONC=16,64,256 bash benchmarks/gpu_dp.sh    # serving (needs .whl: fetch_server_wheels.sh)
#   RUNS="prefix-dp2 prefix-rr kill" bash benchmarks/gpu_dp.sh  # prefix affinity against round-robin; a replica killed
#   RUNS="70b-tp4 70b-dp2tp2" bash benchmarks/gpu_dp.sh          # 4 GPUs: llama-3.1-70b, prefill-heavy and workload A
#
# Serving runs are `minfer bench-serve --launch` with random weights drawn on the GPUs (--load-format dummy: only
# config.json is written), closed loop at SERVE_CONC clients (default 1,16,64,256), fixed 512 in / 128 out
# (SERVE_WORKLOAD), the same prompts for every run:
#   one:  one GPU                              (--tensor-parallel-size 1)
#   tp2:  one engine sharded over two GPUs     (--tensor-parallel-size 2)
#   dp2:  two replicas, one GPU each, behind the balancer (--data-parallel-size 2)
#   prefix-dp2 / prefix-rr: dp2 on the prefix-repetition workload (PREFIX_WORKLOAD: 32 prefixes of 1,024 tokens, 256
#         of each prompt's own, 128 out) at PREFIX_CONC clients (default 64), the balancer's rule against
#         MINFER_DP_ROUTING=round-robin: the prefix cache's hit rate, tok/s and TTFT of each
#   kill: dp2 under 64 clients, replica 1 SIGKILLed 20 s in (benchmarks/dp_failover.py): time until /health names
#         it, until the next request succeeds, the requests failed
#   70b-tp4 / 70b-dp2tp2: llama-3.1-70b, one engine over 4 GPUs against 2 replicas of tp=2, at 16 and 64 clients,
#         prefill-heavy (2,048 in / 128 out) and workload A
# Offline runs (`minfer bench`, workload A, 256 requests): A-one, A-dp2 (two replicas together), A-tp2.
# -> $OUT/serve_<run>/results.json, $OUT/<run>.json, $OUT/failover/, and $OUT/gpu_dp.md: output tok/s, TTFT and TPOT
# p50/p99 per run and level, dp's requests per replica (the balancer's split) and prefix-cache hit rates. A run that
# needs more GPUs than `nvidia-smi -L` lists (NGPUS overrides) is skipped, saying so. ENGINE_ARGS is added to every
# server (e.g. "--max-num-seqs 128"). A CPU dry run:
#   NGPUS=2 MODEL_8B=<a small checkpoint> MAX_LEN=256 SERVE_CONC=4 ENGINE_ARGS="--num-kv-blocks 64" \
#   SERVE_WORKLOAD="--workload fixed --input-len 16 --output-len 8 --num-prompts 8 --token-id-max 200" \
#   PREFIX_WORKLOAD="--workload prefix-repetition --prefix-len 64 --input-len 16 --output-len 8 --num-prompts 32" \
#   PREFIX_CONC=4 FAILOVER_ARGS="--kill-after 2 --concurrency 4 --num-prompts 64 --input-len 16 --output-len 32" \
#   RUNS="one dp2 prefix-dp2 prefix-rr kill A-one A-dp2" bash benchmarks/gpu_dp.sh
PY="${PYTHON:-python3}"
source "$(dirname "$0")/device_call.sh"
RUNS="${RUNS:-one tp2 dp2}"
SERVE_CONC="${SERVE_CONC:-1,16,64,256}"
SERVE_WORKLOAD="${SERVE_WORKLOAD:---workload fixed --input-len 512 --output-len 128}"
PREFIX_CONC="${PREFIX_CONC:-64}"
PREFIX_WORKLOAD="${PREFIX_WORKLOAD:---workload prefix-repetition --num-prefixes 32 --prefix-len 1024 --input-len 256 \
--output-len 128 --num-prompts 512}"
ENGINE_ARGS="${ENGINE_ARGS:-}"
MAX_LEN="${MAX_LEN:-4096}"
if [ -n "${MODEL_8B:-}" ]; then M8=(--model "$MODEL_8B"); else M8=(--shape llama-3.1-8b --load-format dummy); fi
if [ -n "${MODEL_8B:-}" ]; then A8=(--model "$MODEL_8B"); else A8=(--shape llama-3.1-8b); fi
M70=(--shape llama-3.1-70b --load-format dummy)
FAILOVER_ARGS="${FAILOVER_ARGS:---kill-after 20}"  # dp_failover.py's own flags (clients, lengths, when)
NGPUS="${NGPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo "no GPU"; date -u
  git log -1 --format=%h 2>/dev/null; echo "GPUs: $NGPUS; runs: $RUNS; clients: $SERVE_CONC"; } | tee "$OUT/gpu.txt"
: > "$OUT/notes.txt"
note() { echo "$*" | tee -a "$OUT/notes.txt"; }

# serve RUN LIMIT MODEL_ARGS... -- BENCH_ARGS...: one `bench-serve --launch` run into $OUT/serve_RUN
serve() {
  local run=$1 limit=$2; shift 2
  local model=() rest=()
  while [ "$1" != "--" ]; do model+=("$1"); shift; done; shift; rest=("$@")
  echo "== $run ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap "$limit")" "$PY" -m minfer.cli -v bench-serve --launch "${model[@]}" --max-model-len "$MAX_LEN" \
    --port "$port" --output-dir "$OUT/serve_$run" "${rest[@]}" $ENGINE_ARGS > "$OUT/serve_$run.log" 2>&1 \
    || note "$run: exit $? (124: cut by the time limit)"
  tail -7 "$OUT/serve_$run.log"
  port=$(( port + 1 ))
}

port=8051
for run in $RUNS; do
  case "$run" in
    one|A-one) gpus=1 ;;
    tp2|dp2|prefix-dp2|prefix-rr|kill|A-dp2|A-tp2) gpus=2 ;;
    70b-tp4|70b-dp2tp2) gpus=4 ;;
    *) note "unknown run $run (one tp2 dp2 prefix-dp2 prefix-rr kill A-one A-dp2 A-tp2 70b-tp4 70b-dp2tp2)"; continue ;;
  esac
  if [ "$gpus" -gt "$NGPUS" ]; then note "skipped: $run needs $gpus GPUs; $NGPUS visible"; continue; fi
  case "$run" in
    one) serve one 270 "${M8[@]}" --tensor-parallel-size 1 -- --concurrency "$SERVE_CONC" $SERVE_WORKLOAD ;;
    tp2) serve tp2 270 "${M8[@]}" --tensor-parallel-size 2 -- --concurrency "$SERVE_CONC" $SERVE_WORKLOAD ;;
    dp2) serve dp2 270 "${M8[@]}" --data-parallel-size 2 -- --concurrency "$SERVE_CONC" $SERVE_WORKLOAD ;;
    prefix-dp2) serve prefix-dp2 200 "${M8[@]}" --data-parallel-size 2 -- --concurrency "$PREFIX_CONC" \
                  $PREFIX_WORKLOAD ;;
    prefix-rr) MINFER_DP_ROUTING=round-robin serve prefix-rr 200 "${M8[@]}" --data-parallel-size 2 -- \
                 --concurrency "$PREFIX_CONC" $PREFIX_WORKLOAD ;;
    kill) echo "== kill ($(left) s left)"
          # shellcheck disable=SC2086
          timeout "$(cap 200)" "$PY" benchmarks/dp_failover.py --out "$OUT/failover" $FAILOVER_ARGS --port "$port" \
            -- "${M8[@]}" --data-parallel-size 2 --max-model-len "$MAX_LEN" $ENGINE_ARGS > "$OUT/kill.log" 2>&1 \
            || note "kill: exit $?"
          tail -2 "$OUT/kill.log"; port=$(( port + 1 )) ;;
    A-one|A-dp2|A-tp2)
      flag=(--tensor-parallel-size 1); [ "$run" = A-dp2 ] && flag=(--data-parallel-size 2)
      [ "$run" = A-tp2 ] && flag=(--tensor-parallel-size 2)
      BENCH_CAP=180 bench "$run" "${A8[@]}" "${flag[@]}" --max-model-len "$MAX_LEN" $ENGINE_ARGS ;;
    70b-tp4) serve 70b-tp4 270 "${M70[@]}" --tensor-parallel-size 4 -- --concurrency 16,64 \
               --workload fixed --input-len 2048 --output-len 128
             serve 70b-tp4-A 200 "${M70[@]}" --tensor-parallel-size 4 -- --concurrency 64 --workload a ;;
    70b-dp2tp2) serve 70b-dp2tp2 270 "${M70[@]}" --tensor-parallel-size 2 --data-parallel-size 2 -- \
                  --concurrency 16,64 --workload fixed --input-len 2048 --output-len 128
                serve 70b-dp2tp2-A 200 "${M70[@]}" --tensor-parallel-size 2 --data-parallel-size 2 -- \
                  --concurrency 64 --workload a ;;
  esac
done

"$PY" - "$OUT" <<'PY' | tee "$OUT/gpu_dp.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print((out / "gpu.txt").read_text().strip().replace("\n", "; ") + "\n")
offline = [(p.stem, json.loads(p.read_text())) for p in sorted(out.glob("A-*.json"))]
if offline:
    one = dict(offline).get("A-one", {}).get("output_tok_s")
    print("| workload A, offline | output tok/s | per GPU | vs one GPU | preemptions |\n|---|---:|---:|---:|---:|")
    for name, r in offline:
        ratio = f"{r['output_tok_s'] / one:.2f}x" if one else "-"
        print(f"| {name} | {r['output_tok_s']:,.0f} | {r['output_tok_s_per_gpu']:,.0f} | {ratio} | "
              f"{r.get('num_preemptions')} |")
    print()
print("| run | clients | output tok/s | vs one | TTFT p50 / p99 ms | TPOT p50 / p99 ms | failed | prefix hits "
      "| requests per replica |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
base = {}
for path in sorted(out.glob("serve_*/results.json"), key=lambda p: p.stat().st_mtime):
    run, report = path.parent.name.removeprefix("serve_"), json.loads(path.read_text())
    for level in report["levels"]:
        c, tok = level.get("concurrency"), level["output_tok_s"]
        if run == "one":
            base[c] = tok
        ratio = f"{tok / base[c]:.2f}x" if base.get(c) and run != "one" else "-"
        ttft, tpot = level["ttft_ms"], level["tpot_ms"]
        hits = f"{level['prefix_cache_hit_rate']:.1%}" if "prefix_cache_hit_rate" in level else "-"
        print(f"| {run} | {c} | {tok:,.0f} | {ratio} | {ttft['p50']:.0f} / {ttft['p99']:.0f} "
              f"| {tpot['p50']:.1f} / {tpot['p99']:.1f} | {level['failed']} | {hits} | {level.get('routed', '-')} |")
failover = out / "failover" / "failover.json"
if failover.is_file():
    f = json.loads(failover.read_text())
    print(f"\nkill: replica {f['victim']} ({f['running_on_victim_at_kill']} running on it): /health named it after "
          f"{1e3 * f['health_names_it_s']:.0f} ms, the next request succeeded {1e3 * f['next_request_ok_s']:.0f} ms "
          f"after the kill; {f['completed']} completed, {f['failed']} failed ({f['failed_errors']})")
PY
cat "$OUT/notes.txt"
echo "done after $(( SECONDS - START )) s"
