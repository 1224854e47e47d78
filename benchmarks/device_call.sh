# Sourced by the benchmarks/*.sh scripts that make one device call each: strict mode, the output folder,
# the call's time budget, and the Python packages carried as wheels in .whl/ (the device machine has no
# network). Set before sourcing: DEADLINE_DEFAULT (seconds, 560 if unset), PY (python3 if unset).
#   left   prints the seconds left of DEADLINE
#   cap N  a part's timeout: N seconds at most, never past the deadline (5 at least)
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
