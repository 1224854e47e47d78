#!/usr/bin/env bash
# The scheduling policies (minfer/engine/sched_policy.py) served on one H200 (issue 42), in one device call of
# ~9 minutes: llama-3.1-8b with weights drawn on the GPU, `minfer bench-serve` (workload A, token-id prompts) at
# 64 and 256 closed-loop clients (2 x clients requests each) for every policy, one server per policy.
#
#   bash benchmarks/serve_policies.sh                    # needs .whl carried (benchmarks/fetch_server_wheels.sh)
#   POLICIES="fcfs prefill-first@32768" bash benchmarks/serve_policies.sh   # P@N: with --max-num-batched-tokens N
#   POLICIES="prefill-first+thread prefill-first+proc" # P+proc: --engine-process (the engine in its own process, the
#                                                      # default on a GPU); P+thread: --no-engine-process
#   POLICIES="prefill-first prefill-first+si4"         # P+siN: with --stream-interval N (N tokens a chunk)
#
# -> $OUT/policies.md (the table, with the TTFT floor of each level: minfer/benchmark/ttft_floor.py),
#    $OUT/serve_logs.tgz (server and client logs, results.json of each run)
DEADLINE_DEFAULT="${DEADLINE_DEFAULT:-560}"
source "$(dirname "$0")/device_call.sh"
POLICIES="${POLICIES:-fcfs prefill-first kv-predict}"
LEVELS="${LEVELS:-64,256}"
PORT="${PORT:-8013}"
LOGS="$OUT/serve_policies"; mkdir -p "$LOGS"
MODEL=/tmp/minfer-shapes/llama-3.1-8b-dummy
"$PY" -c "from pathlib import Path; from minfer.benchmark.shapes import write_shape_config as w; \
w('llama-3.1-8b', Path('$MODEL'))"

# CPU seconds (user + system, all threads) of the server process and of its children (an --engine-process engine,
# tensor-parallel workers), over a run: per second of wall time and per output token. The engine thread and the
# event loop of one process share a GIL, so a process near 1 CPU-second a second is host-bound
# (dev/server_overhead.py prices the same work on a CPU machine, the model stubbed out).
cpu_s() {
  local tck kids; tck=$(getconf CLK_TCK); kids=$(cat /proc/"$1"/task/*/children 2>/dev/null)
  for p in "$1" "${kids:-}"; do
    [ -n "$p" ] || { echo 0; continue; }
    awk -v t="$tck" '{ split($0, a, ") "); split(a[2], f, " "); s += (f[12] + f[13]) / t } END { print s + 0 }' \
      $(for q in $p; do echo "/proc/$q/stat"; done) 2>/dev/null || echo 0
  done | paste -sd' '
}

for entry in $POLICIES; do
  interval=""; [ "${entry%+si*}" != "$entry" ] && { interval="${entry##*+si}"; entry="${entry%+si*}"; }
  proc=""; [ "${entry%+proc}" != "$entry" ] && { proc=--engine-process; entry="${entry%+proc}"; }
  [ "${entry%+thread}" != "$entry" ] && { proc=--no-engine-process; entry="${entry%+thread}"; }
  policy="${entry%@*}"; tokens=""; [ "$entry" != "$policy" ] && tokens="${entry#*@}"
  layout=""; [ "$proc" = --engine-process ] && layout=_proc; [ "$proc" = --no-engine-process ] && layout=_thread
  name="${policy}${tokens:+_$tokens}${layout}${interval:+_si$interval}"
  echo "== serve llama-3.1-8b, --scheduling-policy $policy${tokens:+ --max-num-batched-tokens $tokens} $proc" \
       "${interval:+--stream-interval $interval} ($(left) s left)"
  "$PY" -m minfer.cli serve --model "$MODEL" --load-format dummy --skip-tokenizer-init --max-model-len 4096 \
    --max-num-seqs 256 --scheduling-policy "$policy" ${tokens:+--max-num-batched-tokens "$tokens"} $proc \
    ${interval:+--stream-interval "$interval"} --port "$PORT" \
    --no-access-log --uvicorn-log-level warning > "$LOGS/server_$name.log" 2>&1 &
  SERVER=$!
  up=0
  for _ in $(seq 1 60); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && { up=1; break; }
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 2
  done
  if [ "$up" = 1 ]; then
    echo "   server up ($(left) s left)"
    cpu0=$(cpu_s "$SERVER"); t0=$SECONDS
    timeout "$(cap 200)" "$PY" -m minfer.cli bench-serve --base-url "http://127.0.0.1:$PORT" --concurrency "$LEVELS" \
      --output-dir "$LOGS/$name" > "$LOGS/bench_$name.log" 2>&1 || echo "   exit $? (124: cut by the time limit)"
    echo "$(cpu_s "$SERVER") $cpu0 $(( SECONDS - t0 ))" > "$LOGS/$name/server_cpu.txt"
    tail -4 "$LOGS/bench_$name.log"
  else
    echo "   no server: $(grep -E 'Error' "$LOGS/server_$name.log" | tail -2)"
  fi
  kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null
  [ "$(left)" -lt 120 ] && { echo "   stopping: $(left) s left"; break; }
done

"$PY" - "$LOGS" "$OUT/policies.md" "$LEVELS" <<'PY'
import json, sys
from pathlib import Path
logs, out, levels = Path(sys.argv[1]), Path(sys.argv[2]), [int(v) for v in sys.argv[3].split(",")]
rows = ["| policy | clients | ok | output tok/s | TTFT p50 | p90 | p99 ms | ITL p50 | p99 ms | TPOT p50 ms "
        "| preemptions (server total) | server CPU-s/s, us/token (all levels; children: an engine process) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for f in sorted(logs.glob("*/results.json"), key=lambda f: f.stat().st_mtime):
    r = json.loads(f.read_text())
    pre = (r.get("engine_stats_after") or {}).get("num_preemptions", "")
    cpu = ""
    if (f.parent / "server_cpu.txt").is_file():
        api1, kids1, api0, kids0, wall = (float(v) for v in (f.parent / "server_cpu.txt").read_text().split())
        tokens = max(sum(lv["output_tokens"] for lv in r["levels"]), 1)
        cpu = f"{(api1 - api0) / max(wall, 1):.2f}, {1e6 * (api1 - api0) / tokens:.0f}"
        if kids1 - kids0 > 0.5:
            cpu += f"; children {(kids1 - kids0) / max(wall, 1):.2f}, {1e6 * (kids1 - kids0) / tokens:.0f}"
    for lv in r["levels"]:
        t, i, p = lv["ttft_ms"], lv["itl_ms"], lv["tpot_ms"]
        rows.append(f"| {f.parent.name} | {lv['concurrency']} | {lv['completed']}/{lv['num_prompts']} "
                    f"| {lv['output_tok_s']:,.0f} | {t['p50']:,.0f} | {t['p90']:,.0f} | {t['p99']:,.0f} "
                    f"| {i['p50']:.1f} | {i['p99']:.1f} | {p['p50']:.1f} | {pre} | {cpu} |")
from minfer.benchmark.bounds import DecodeCost
from minfer.benchmark.shapes import shape_config
from minfer.benchmark.ttft_floor import floor_summary
from minfer.model.registry import model_config
cost = DecodeCost.for_model(model_config(shape_config("llama-3.1-8b")))
rows += ["", "TTFT floor (every prompt's prefill FLOPs at 793 TFLOP/s; the burst of the first N requests served "
         "shortest first; minfer/benchmark/ttft_floor.py):", ""]
for level in levels:
    s = floor_summary(cost, level)
    rows.append(f"- {level} clients: burst {s['burst_tokens']:,} prompt tokens = {s['burst_s']:.2f} s; floor TTFT "
                f"p50 {s['p50_ms']:,.0f} ms, p90 {s['p90_ms']:,.0f} ms, p99 {s['p99_ms']:,.0f} ms")
out.write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
(cd "$OUT" && tar czf serve_logs.tgz --remove-files serve_policies 2>/dev/null)
echo "serve_policies done in $(( SECONDS - START )) s"
