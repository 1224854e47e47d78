# Sourced by the benchmarks/*.sh scripts that make one device call each: strict mode, the output folder,
# the call's time budget, and the Python packages carried as wheels in .whl/ (the device machine has no
# network). Set before sourcing: DEADLINE_DEFAULT (seconds, 560 if unset), PY (python3 if unset).
#   left   prints the seconds left of DEADLINE
#   cap N  a part's timeout: N seconds at most, never past the deadline (5 at least)
#   bench NAME ARGS...  one `minfer bench --load-format dummy` run (BENCH_CAP seconds at most, default 200) into
#          $OUT/NAME.json and .log, its key lines printed
#   bench_table FILE   the runs' JSON under $OUT as one markdown table, printed and written to $OUT/FILE
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
PY="${PY:-python3}"
DEADLINE="${DEADLINE:-${DEADLINE_DEFAULT:-560}}"; START=$SECONDS
left() { echo $(( DEADLINE - (SECONDS - START) )); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 5 ? l : 5) : $1 )); }
WHEEL_DIR="${WHEEL_DIR:-.whl}"  # .whl_min: fetch_server_wheels.sh --min, when .whl and the tree pass the carry limit
if ls "$WHEEL_DIR"/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$WHEEL_DIR"/*.whl 2>&1 | tail -2
  export PYTHONPATH="/tmp/site:$PWD"
  WHEELS=1
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  WHEELS=0
fi

bench() {
  local name=$1; shift
  echo "== $name ($(left) s left)"
  timeout "$(cap "${BENCH_CAP:-200}")" "$PY" -m minfer.cli -v bench --load-format dummy --quiet \
    --output-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 \
    || echo "   exit $? (124: cut by the time limit); $(grep -E 'Error' "$OUT/$name.log" | tail -2)"
  grep -E "state cache|KV cache:|hybrid KV|\"output_tok_s|decode_tok_s|share_of_bound" "$OUT/$name.log" | head -6
}

bench_table() {
  "$PY" - "$OUT" "$1" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lines = ["| run | output tok/s | wall s | share of bound | preemptions |", "|---|---|---|---|---|"]
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    if "batch1" in r:
        b = r["batch1"]
        lines.append(f"| {f.stem} | {b['decode_tok_s']:,.1f} | | {100 * b['share_of_bound']:.1f}% of {b['bound_tok_s']:,.0f} | |")
    elif "output_tok_s" in r:
        lines.append(f"| {f.stem} | {r['output_tok_s']:,.0f} | {r['seconds']:.1f} | {100 * r.get('share_of_bound', 0):.1f}% "
                     f"| {r['num_preemptions']} |")
(out / sys.argv[2]).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
}
