#!/usr/bin/env bash
# Start-up time of `minfer serve` (launch -> /health answers) on llama-3.1-8b random weights, one H200,
# cold (empty Triton/Inductor/CUDA caches) then warm (the caches the cold run filled), in one command
# that ends within ~9 minutes (DEADLINE seconds):
#
#   bash benchmarks/startup.sh        # $OUT/startup.md (the table), $OUT/startup_{cold,warm}.log (server logs)
#
# Needs fastapi/uvicorn/pydantic: `bash benchmarks/fetch_server_wheels.sh` here, and carry .whl.
# Every server log line is prefixed with seconds since launch; the table lists the engine's
# "start-up: <phase> took X s" lines, when the first minfer line (~ imports done), "KV cache:",
# "captured ... CUDA graphs" and "serving ..." appeared, and launch -> healthy.
# The checkpoint write is timed apart; its files stay in the page cache, so "cold" is cold compile caches,
# not a cold disk. Overrides for a CPU dry run: PYTHON, MODEL, SERVE_ARGS, PORT, SKIP_CHECKPOINT=1, e.g.
#   PYTHON=/work/venv/bin/python SKIP_CHECKPOINT=1 MODEL=minfer/assets/builtin-model \
#     SERVE_ARGS="--skip-tokenizer-init --max-model-len 1024" bash benchmarks/startup.sh
PY="${PYTHON:-python3}"
DEADLINE_DEFAULT=540
source "$(dirname "$0")/device_call.sh"
MODEL="${MODEL:-/tmp/minfer-shapes/llama-3.1-8b}"
SERVE_ARGS="${SERVE_ARGS---skip-tokenizer-init --max-model-len 4096 --max-num-seqs 256}"
PORT="${PORT:-8011}"
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no GPU"; date -u
  git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

CKPT="skipped"
if [ -z "${SKIP_CHECKPOINT:-}" ]; then
  t=$(now)
  "$PY" -c "from pathlib import Path; from minfer.benchmark.shapes import write_random_checkpoint as w; \
w('llama-3.1-8b', Path('$MODEL'), device='cuda')" && CKPT="$(secs "$t" "$(now)") s" || CKPT="failed (exit $?)"
  echo "checkpoint: $CKPT"
fi

stamp() {  # prefix each line read with the seconds since $1 (epoch seconds)
  "$PY" -u -c '
import sys, time
t0 = float(sys.argv[1])
for line in iter(sys.stdin.readline, ""):
    sys.stdout.write("%8.2f %s" % (time.time() - t0, line))
    sys.stdout.flush()' "$1"
}

CACHE=$(mktemp -d /tmp/minfer-startup-cache.XXXXXX)  # empty: the cold run fills it, the warm run reuses it
export TRITON_CACHE_DIR="$CACHE/triton" TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" CUDA_CACHE_PATH="$CACHE/cuda"

run() {  # cold|warm, then the seconds it may take: launch, wait for /health, SIGTERM, check nothing is left
  local name=$1 limit=$2 log="$OUT/startup_$1.log" t0 t pid rc healthy="not healthy" stop left_over
  echo "== $name (limit $limit s; triton cache: $(find "$CACHE" -type f 2>/dev/null | wc -l) files)"
  t0=$(now)
  # setsid: the server leads its own process group, so anything it started and left behind can be found
  # shellcheck disable=SC2086
  setsid "$PY" -m minfer.cli -v serve --model "$MODEL" $SERVE_ARGS --port "$PORT" --no-access-log \
    --uvicorn-log-level warning > >(stamp "$t0" > "$log") 2>&1 &
  pid=$!; SERVER=$pid
  while (( $(awk -v a="$t0" -v b="$(now)" 'BEGIN { print int(b - a) }') < limit )); do
    if curl -sf -m 2 "http://127.0.0.1:$PORT/health" > /dev/null; then healthy="$(secs "$t0" "$(now)") s"; break; fi
    kill -0 "$pid" 2>/dev/null || { healthy="exited before healthy"; break; }
    sleep 0.2
  done
  echo "   launch -> healthy: $healthy"
  t=$(now)
  if ! kill -TERM "$pid" 2>/dev/null; then stop="had exited"
  else
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then stop="still running after 20 s: SIGKILL"; kill -KILL "$pid"; fi
  fi
  wait "$pid"; rc=$?; stop="${stop:-stopped in $(secs "$t" "$(now)") s}, exit $rc"  # 143: uvicorn re-raises SIGTERM
  sleep 0.5  # the stamp filter drains the last lines
  left_over=$( { pgrep -f "minfer.cli.*--port $PORT"; pgrep -g "$pid"; } 2>/dev/null | sort -u | paste -sd " ")
  [ -n "$left_over" ] && { ps -o pid,args -p "${left_over// /,}" | tee "$OUT/startup_${name}_left.txt"
                           kill -KILL $left_over 2>/dev/null; }
  echo "   SIGTERM: $stop; processes left: ${left_over:-none}"
  printf '%s\t%s\t%s\t%s\n' "$name" "$healthy" "$stop" "${left_over:-none}" >> "$OUT/startup_runs.tsv"
}
SERVER=; trap '[ -n "$SERVER" ] && kill -KILL "$SERVER" 2>/dev/null' EXIT
rm -f "$OUT/startup_runs.tsv"
run cold $(( $(left) - 90 > 300 ? 300 : $(left) - 90 ))
run warm $(( $(left) - 10 ))

"$PY" - "$OUT" "$CKPT" <<'PY' | tee "$OUT/startup.md"
import re, sys
from pathlib import Path
out, ckpt = Path(sys.argv[1]), sys.argv[2]
runs = {r.split("\t")[0]: r.split("\t")[1:] for r in (out / "startup_runs.tsv").read_text().splitlines()}
names = list(runs)
rows: dict[str, dict[str, str]] = {}
line_re = re.compile(r"^\s*([\d.]+) (minfer[\w.]*): (.*)$")
for name in names:
    phases = None
    for line in (out / f"startup_{name}.log").read_text().splitlines():
        m = line_re.match(line)
        if not m:
            continue
        t, msg = float(m[1]), m[3]
        rows.setdefault("first minfer log line (~ imports), at", {}).setdefault(name, f"{t:.2f} s")
        if p := re.match(r"start-up: (.+?) took ([\d.]+) ?s", msg):
            rows.setdefault(f"start-up: {p[1]}", {})[name] = f"{float(p[2]):.2f} s"
            phases = (phases or 0.0) + float(p[2])
        for key, pat in (("'KV cache:' logged at", r"KV cache:"), ("'captured ... CUDA graphs' at", r"captured \d+"),
                         ("'serving ...' (engine ready) at", r"serving ")):
            if re.match(pat, msg):
                rows.setdefault(key, {})[name] = f"{t:.2f} s"
    healthy, stop, left = runs[name]
    rows.setdefault("sum of start-up phases", {})[name] = "-" if phases is None else f"{phases:.2f} s"
    rows.setdefault("**launch -> healthy**", {})[name] = f"**{healthy}**"
    rows.setdefault("SIGTERM", {})[name] = stop
    rows.setdefault("processes left after", {})[name] = left
    if not healthy.endswith(" s"):  # why: the last line of its log
        last = (out / f"startup_{name}.log").read_text().strip().splitlines() or ["(empty log)"]
        rows.setdefault("last log line", {})[name] = last[-1].strip().replace("|", "\\|")[:200]
order = [k for k in rows if not k.startswith("start-up:")]
order = order[:1] + [k for k in rows if k.startswith("start-up:")] + order[1:]
print(f"`minfer serve` start-up (seconds since launch; checkpoint write, not included: {ckpt})\n")
print("| | " + " | ".join(names) + " |")
print("|---|" + "---:|" * len(names))
for k in order:
    print(f"| {k} | " + " | ".join(rows[k].get(n, "-") for n in names) + " |")
PY
rm -rf "$CACHE"
echo "done in $(( SECONDS - START )) s"
