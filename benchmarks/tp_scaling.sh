#!/usr/bin/env bash
# Tensor-parallel scaling (issue 21) on 2 or 4 H200s, in one command per part that ends within ~9.5 minutes
# (DEADLINE seconds); results under $OUT (default /tmp/minfer-out), the table in $OUT/tp_scaling.md:
#
#   PARTS=a bash benchmarks/tp_scaling.sh          # 2 GPUs: each part in its own call (~3-5 min each)
#   PARTS=batch1 bash benchmarks/tp_scaling.sh
#   PARTS=serve bash benchmarks/tp_scaling.sh      # needs the server's wheels: fetch_server_wheels.sh, carry .whl
#   PARTS=70b bash benchmarks/tp_scaling.sh        # 4 GPUs (70b = 70b_a 70b_batch1 70b_startup; one at a time
#                                                  #   if the 141 GB checkpoint write leaves too little time)
#   TP_LIST=1 PARTS="a batch1 serve 70b" bash benchmarks/tp_scaling.sh   # dry run on ONE GPU: everything at tp=1
#
# a:       workload A on llama-3.1-8b at each tp of TP_LIST (default "1 2") in the same call: output tok/s, per
#          GPU, the ratio to tp=1, the share of the N-GPU bounds, and each run's KV blocks (per GPU; tokens
#          cached = blocks x 16) and preemptions, which tell a memory gain (more sequences resident) from a
#          compute/bandwidth one. EQUAL_KV=1 adds a tp=2 run capped at tp=1's KV blocks (compute gain alone).
# batch1:  `minfer bench --batch1` (512 tokens) on llama-3.1-8b per tp: tok/s, ratio, share of the N-GPU
#          weight-bandwidth bound (N x 4.22 TB/s over the weights read per token).
# serve:   `minfer bench-serve --launch --tensor-parallel-size N` per tp, concurrency 1,16,64,256 (SERVE_CONC),
#          fixed 512 in / 128 out as in RESULTS.md (SERVE_WORKLOAD).
# 70b:     llama-3.1-70b (workload A and batch 1: random bf16 weights drawn on the GPUs; start-up: 141 GB written
#          once to /tmp/minfer-shapes, reused while the machine stays warm, a write cut off by the time limit resuming
#          at the next call) at TP_70B (default 4): workload A (70b_a),
#          batch 1 (70b_batch1), and `minfer serve` launch -> /health healthy (70b_startup).
# A part or tp that needs more GPUs than `nvidia-smi -L` lists (NGPUS overrides) is skipped, saying so.
# Dry run (every tp in TP_LIST is 1): the 70b parts run at tp=1 on LAYERS_70B (default 8) of the 70B's 80 layers,
# which fit one H200 and its disk. Overrides for a CPU check: PYTHON, NGPUS, MODEL_8B / MODEL_70B (checkpoint
# folders used instead of the shapes), BENCH_ARGS (e.g. "--num-prompts 4 --input-len 8 --output-len 4" instead
# of workload A), BATCH1_ARGS, SERVE_WORKLOAD, ENGINE_ARGS (added to every engine), SERVE_ARGS (to serve runs).
PY="${PYTHON:-python3}"
source "$(dirname "$0")/device_call.sh"
PARTS=" ${PARTS:-a batch1 serve 70b} "; PARTS="${PARTS/ 70b / 70b_a 70b_batch1 70b_startup }"
TP_LIST="${TP_LIST:-1 2}"
has() { case "$PARTS" in *" $1 "*) return 0 ;; esac; return 1; }
NGPUS="${NGPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
DRY=1; for tp in $TP_LIST; do [ "$tp" -gt 1 ] && DRY=0; done
if [ "$DRY" = 1 ]; then TP_70B="${TP_70B:-1}"; LAYERS_70B="${LAYERS_70B:-8}"; else TP_70B="${TP_70B:-4}"; LAYERS_70B="${LAYERS_70B:-80}"; fi
ENGINE_ARGS="${ENGINE_ARGS:-}"; SERVE_ARGS="${SERVE_ARGS:-}"; BENCH_ARGS="${BENCH_ARGS:-}"; BATCH1_ARGS="${BATCH1_ARGS:-}"
SERVE_CONC="${SERVE_CONC:-1,16,64,256}"
SERVE_WORKLOAD="${SERVE_WORKLOAD:---workload fixed --input-len 512 --output-len 128}"
SHAPES_DIR=/tmp/minfer-shapes
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no GPU"; date -u; git log -1 --format=%h 2>/dev/null
  echo "GPUs: $NGPUS; TP_LIST: $TP_LIST; 70B: tp=$TP_70B, $LAYERS_70B layers; parts:$PARTS"; } | tee "$OUT/gpu.txt"
: > "$OUT/notes.txt"
note() { echo "$*" | tee -a "$OUT/notes.txt"; }
fits() {  # tp, what: whether tp GPUs are visible (else a note)
  [ "$1" -le "$NGPUS" ] && return 0
  note "skipped: $2 at tp=$1 needs $1 GPUs; $NGPUS visible"; return 1
}

write_shape() {  # shape, folder, layers: the random checkpoint (reused when present), timed
  local t0=$SECONDS
  timeout "$(cap 400)" "$PY" -c "import sys, torch; from pathlib import Path
from minfer.benchmark.shapes import write_random_checkpoint as w
w(sys.argv[1], Path(sys.argv[2]), layers=int(sys.argv[3]) if sys.argv[3] else None,
  device='cuda' if torch.cuda.is_available() else 'cpu')" "$1" "$2" "${3:-}" || { note "checkpoint $2: exit $?"; return 1; }
  note "checkpoint $2 ready after $(( SECONDS - t0 )) s ($(du -sh "$2" | cut -f1))"
}
if [ -n "${MODEL_8B:-}" ]; then M8=(--model "$MODEL_8B")
else
  M8=(--shape llama-3.1-8b)
  if has a || has batch1 || has serve; then write_shape llama-3.1-8b "$SHAPES_DIR/llama-3.1-8b"; fi
fi
# The 70B's throughput parts draw their random weights on the GPUs (--load-format dummy: nothing to write);
# only the start-up part, which times a real load, needs the 141 GB checkpoint on disk.
if [ -n "${MODEL_70B:-}" ]; then M70DIR="$MODEL_70B"; M70=(--model "$MODEL_70B")
elif [ "$LAYERS_70B" = 80 ]; then M70DIR="$SHAPES_DIR/llama-3.1-70b"; M70=(--shape llama-3.1-70b --load-format dummy)
else M70DIR="$SHAPES_DIR/llama-3.1-70b-${LAYERS_70B}l"
  M70=(--shape llama-3.1-70b --shape-layers "$LAYERS_70B" --load-format dummy); fi
if [ -z "${MODEL_70B:-}" ] && has 70b_startup && [ "$TP_70B" -le "$NGPUS" ]; then
  if [ "$LAYERS_70B" = 80 ]; then write_shape llama-3.1-70b "$M70DIR"; else write_shape llama-3.1-70b "$M70DIR" "$LAYERS_70B"; fi
fi

bench() {  # name, limit (s), then minfer bench arguments
  local name=$1 limit=$2; shift 2
  echo "== $name ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap "$limit")" "$PY" -m minfer.cli -v bench --quiet --output-json "$OUT/$name.json" "$@" $ENGINE_ARGS \
    > "$OUT/$name.log" 2>&1 || note "$name: exit $? (124: cut by the time limit)"
  grep -E "KV cache:|start-up: load|\"output_tok_s\"|\"decode_tok_s\"|preemptions|share_of_bound|Error" "$OUT/$name.log" | head -8
}
kv_blocks() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['num_kv_blocks'])" "$1" 2>/dev/null; }

if has a; then
  for tp in $TP_LIST; do
    # shellcheck disable=SC2086
    fits "$tp" "workload A" && bench "a_tp$tp" 240 "${M8[@]}" --tensor-parallel-size "$tp" $BENCH_ARGS
  done
  if [ "${EQUAL_KV:-0}" = 1 ] && [ -f "$OUT/a_tp1.json" ] && fits 2 "workload A (tp=1's KV blocks)"; then
    # shellcheck disable=SC2086
    bench a_tp2_kv_of_tp1 240 "${M8[@]}" --tensor-parallel-size 2 --num-kv-blocks "$(kv_blocks "$OUT/a_tp1.json")" $BENCH_ARGS
  fi
fi
if has batch1; then
  for tp in $TP_LIST; do
    # shellcheck disable=SC2086
    fits "$tp" "batch 1" && bench "b1_tp$tp" 200 "${M8[@]}" --batch1 --max-num-seqs 8 --tensor-parallel-size "$tp" $BATCH1_ARGS
  done
fi
if has serve; then
  port=8031
  for tp in $TP_LIST; do
    fits "$tp" "bench-serve" || continue
    echo "== serve_tp$tp ($(left) s left)"
    # shellcheck disable=SC2086
    timeout "$(cap 280)" "$PY" -m minfer.cli -v bench-serve --launch "${M8[@]}" --tensor-parallel-size "$tp" \
      --port "$port" --concurrency "$SERVE_CONC" $SERVE_WORKLOAD --output-dir "$OUT/serve_tp$tp" $ENGINE_ARGS $SERVE_ARGS \
      > "$OUT/serve_tp$tp.log" 2>&1 || note "serve_tp$tp: exit $? (124: cut by the time limit)"
    tail -8 "$OUT/serve_tp$tp.log"
    port=$(( port + 1 ))
  done
fi
if has 70b_a && fits "$TP_70B" "llama-3.1-70b workload A"; then
  # shellcheck disable=SC2086
  bench "70b_a_tp$TP_70B" 300 "${M70[@]}" --tensor-parallel-size "$TP_70B" $BENCH_ARGS
fi
if has 70b_batch1 && fits "$TP_70B" "llama-3.1-70b batch 1"; then
  # shellcheck disable=SC2086
  bench "70b_b1_tp$TP_70B" 240 "${M70[@]}" --batch1 --max-num-seqs 8 --tensor-parallel-size "$TP_70B" $BATCH1_ARGS
fi
if has 70b_startup && fits "$TP_70B" "llama-3.1-70b server start-up"; then
  echo "== 70b_startup ($(left) s left)"
  port=8041 limit=$(cap 300) t0=$(date +%s.%N) healthy="" died=""
  # shellcheck disable=SC2086
  "$PY" -m minfer.cli -v serve --model "$M70DIR" --skip-tokenizer-init --max-model-len 4096 --tensor-parallel-size "$TP_70B" \
    --port "$port" --no-access-log --uvicorn-log-level warning $ENGINE_ARGS $SERVE_ARGS > "$OUT/70b_startup.log" 2>&1 &
  SERVER=$!
  trap '[ -n "${SERVER:-}" ] && kill -KILL "$SERVER" 2>/dev/null' EXIT
  while (( $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print int(b - a) }') < limit )); do
    if curl -sf -m 2 "http://127.0.0.1:$port/health" > /dev/null; then
      healthy=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'); break
    fi
    kill -0 "$SERVER" 2>/dev/null || { died=1; break; }
    sleep 0.2
  done
  if [ -n "$healthy" ]; then
    curl -sf "http://127.0.0.1:$port/stats" > "$OUT/70b_startup_stats.json"
    echo "{\"tensor_parallel_size\": $TP_70B, \"model\": \"$M70DIR\", \"healthy_after_s\": $healthy}" > "$OUT/70b_startup.json"
  elif [ -n "$died" ]; then note "70b_startup: the server exited before it was healthy: $(tail -1 "$OUT/70b_startup.log")"
  else note "70b_startup: not healthy within $limit s (see 70b_startup.log)"; fi
  grep -E "start-up:|KV cache:|Error" "$OUT/70b_startup.log" | head -8
  kill -TERM "$SERVER" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; SERVER=
  echo "   launch -> healthy: ${healthy:-never} s"
fi

"$PY" - "$OUT" <<'PY' | tee "$OUT/tp_scaling.md"
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None


def runs(prefix):  # {tp: result} of prefix_tp<N>.json
    found = {}
    for p in sorted(out.glob(f"{prefix}_tp*.json")):
        m = re.fullmatch(rf"{prefix}_tp(\d+)", p.stem)
        if m:
            found[int(m[1])] = json.loads(p.read_text())
    return dict(sorted(found.items()))


def ratio(x, base):
    return f"{x / base:.2f}x" if base else "-"


print((out / "gpu.txt").read_text().strip().replace("\n", "; ") + "\n")
for title, prefix in (("Workload A, llama-3.1-8b", "a"), ("Workload A, llama-3.1-70b", "70b_a")):
    rs = runs(prefix)
    if prefix == "a" and (extra := load("a_tp2_kv_of_tp1.json")):
        rs["2 (tp=1's KV blocks)"] = extra
    if not rs:
        continue
    base = next(iter(rs.values()))["output_tok_s"]
    print(f"### {title} ({next(iter(rs.values())).get('workload')})\n")
    print("| tp | output tok/s | per GPU | vs first row | share of N-GPU bound | share of sum bound | bound / sum bound "
          "tok/s | KV blocks per GPU | KV tokens | preemptions | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tp, r in rs.items():
        b = r["bounds"]
        print(f"| {tp} | {r['output_tok_s']:,.0f} | {r['output_tok_s_per_gpu']:,.0f} | {ratio(r['output_tok_s'], base)} "
              f"| {100 * r['share_of_bound']:.1f}% | {100 * r['share_of_sum_bound']:.1f}% | {b['bound_tok_s']:,.0f} / "
              f"{b['sum_bound_tok_s']:,.0f} | {r['num_kv_blocks']:,} | {r['kv_cache_tokens']:,} | {r['num_preemptions']} "
              f"| {r['seconds']:.1f} |")
    if all(r["num_preemptions"] == 0 for r in rs.values()) and len(rs) > 1:
        print("\nNo run preempted: every sequence was resident at every tp, so the difference is compute/bandwidth "
              "(and communication), not memory.")
    print()
for title, prefix in (("Batch-1 decode, llama-3.1-8b", "b1"), ("Batch-1 decode, llama-3.1-70b", "70b_b1")):
    rs = runs(prefix)
    if not rs:
        continue
    base = next(iter(rs.values()))["batch1"]["decode_tok_s"]
    print(f"### {title}\n")
    print("| tp | decode tok/s | per GPU | vs first row | N-GPU weight-bandwidth bound | share | weights read / token "
          "(per GPU) | TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for tp, r in rs.items():
        b = r["batch1"]
        print(f"| {tp} | {b['decode_tok_s']:,.1f} | {b['decode_tok_s_per_gpu']:,.1f} | {ratio(b['decode_tok_s'], base)} "
              f"| {b['bound_tok_s']:,.1f} ({b['bandwidth_tb_s']} TB/s) | {100 * b['share_of_bound']:.1f}% "
              f"| {b['weights_gib']:.2f} GiB ({b['weights_per_gpu_gib']:.2f}) | {1e3 * b['ttft_s']:.1f} |")
    print()
serve = {}
for p in sorted(out.glob("serve_tp*/results.json")):
    serve[int(p.parent.name.removeprefix("serve_tp"))] = json.loads(p.read_text())
if serve:
    serve = dict(sorted(serve.items()))
    tps = list(serve)
    print("### `minfer bench-serve --launch`, llama-3.1-8b (" + ", ".join(
        f"tp={tp}: {r['args'].get('workload')} {r['args'].get('input_len')} in / {r['args'].get('output_len')} out"
        for tp, r in serve.items()) + ")\n")
    print("| concurrency | " + " | ".join(f"tp={tp} out tok/s | TTFT p50 ms | TPOT p50 ms" for tp in tps)
          + (" | ratio |" if len(tps) > 1 else " |"))
    print("|---|" + "---:|---:|---:|" * len(tps) + ("---:|" if len(tps) > 1 else ""))
    levels = {lv["concurrency"]: {} for r in serve.values() for lv in r["levels"] if "concurrency" in lv}
    for tp, r in serve.items():
        for lv in r["levels"]:
            levels.setdefault(lv.get("concurrency"), {})[tp] = lv
    for c, by_tp in levels.items():
        cells = []
        for tp in tps:
            lv = by_tp.get(tp)
            cells.append(f"{lv['output_tok_s']:,.0f} | {lv['ttft_ms']['p50']:.1f} | {lv['tpot_ms']['p50']:.1f}"
                         if lv else "- | - | -")
        last = ""
        if len(tps) > 1:
            a, b = by_tp.get(tps[0]), by_tp.get(tps[-1])
            last = f" | {ratio(b['output_tok_s'], a['output_tok_s'])}" if a and b else " | -"
        print(f"| {c} | " + " | ".join(cells) + last + " |")
    print()
if (s := load("70b_startup.json")):
    stats = load("70b_startup_stats.json") or {}
    layers = json.loads((Path(s["model"]) / "config.json").read_text())["num_hidden_layers"]
    print(f"### `minfer serve`, llama-3.1-70b ({layers} layers), tp={s['tensor_parallel_size']}: launch -> /health "
          f"healthy in **{s['healthy_after_s']} s** (KV blocks per GPU: {stats.get('num_kv_blocks', '?')})\n")
    phases = [ln.removeprefix("minfer: start-up: ") for ln in (out / "70b_startup.log").read_text().splitlines()
              if ln.startswith("minfer: start-up: ")]  # rank 0's (the workers' lines say minfer[tpN])
    if phases:
        print("Start-up phases (rank 0): " + "; ".join(phases) + "\n")
notes = (out / "notes.txt").read_text().strip()
if notes:
    print("Notes:\n\n" + "\n".join(f"- {n}" for n in notes.splitlines()))
PY
echo "done in $(( SECONDS - START )) s"
