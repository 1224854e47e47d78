#!/usr/bin/env bash
# Mixture of experts on one H200, in parts that each fit one device call (10 minutes):
#   PARTS=kernels   the fused MoE kernel table (benchmarks/bench_moe.py -> $OUT/moe.md) and the MoE gpu tests
#   PARTS=engine    minfer bench with random weights drawn on the GPU (--load-format dummy: only config.json is
#                   written; qwen3-30b-a3b's 61 GB and mixtral-8x7b's 93 GB do not fit the 64 GiB disk):
#                   workload A and batch 1 on qwen3-30b-a3b, workload A on mixtral-8x7b, and workload A on the
#                   dense llama-3.1-8b for reference, in the same call
#   PARTS=fp8       workload A on qwen3-30b-a3b with --quantization fp8 (attention FP8, experts bf16)
# Each bench run is cut at RUN_TIMEOUT seconds (default 135, so four runs fit one call; RUN_TIMEOUT_FP8 300).
# -v logs the start-up times (weights drawn, memory profile, graphs). Results (JSON, logs, a summary table)
# go under $OUT.
source "$(dirname "$0")/device_call.sh"
RUN_TIMEOUT="${RUN_TIMEOUT:-135}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"
run() {  # name, then minfer bench arguments
  local name=$1; shift
  rm -f "$OUT/$name.json"
  timeout "$RUN_TIMEOUT" python3 -m minfer.cli bench -v --quiet --load-format dummy \
    --output-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 \
    || echo "   $name: exit $? (124: cut by the time limit); $(tail -2 "$OUT/$name.log")"
  python3 - "$OUT/$name.json" "$name" "$OUT/$name.log" <<'PY' | tee -a "$OUT/summary.md"
import json, re, sys
log = open(sys.argv[3], errors="replace").read()
load = re.search(r"load weights took ([0-9.]+) s", log)
load = f"; weights drawn in {load.group(1)} s" if load else ""
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    sys.exit(print(f"| {sys.argv[2]} | failed |  |"))
b = d.get("batch1")
if b:
    print(f"| {sys.argv[2]} | batch 1: {b['decode_tok_s']:,.1f} tok/s, TTFT {b['ttft_s']} s | "
          f"{100 * b['share_of_bound']:.1f}% of {b['bound_tok_s']:,.0f} "
          f"({b['weights_gib']} GiB read per token){load} |")
else:
    print(f"| {sys.argv[2]} | {d['output_tok_s']:,.1f} output tok/s, {d['total_tok_s']:,.1f} total | "
          f"{100 * d['share_of_bound']:.1f}% of bound; {d['num_kv_blocks']} KV blocks, "
          f"{d['num_preemptions']} preemptions{load} |")
PY
}
case " ${PARTS:-kernels} " in *" kernels "*)
  timeout 240 python3 benchmarks/bench_moe.py > "$OUT/bench_moe.log" 2>&1 \
    || echo "bench_moe.py: exit $? (124: cut by the time limit); $(tail -2 "$OUT/bench_moe.log")"
  cat "$OUT/moe.md" 2>/dev/null
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernel_moe_gpu.py \
    tests/kernels/test_kernel_moe.py tests/engine/test_moe_gpu.py -rs > "$OUT/moe_gpu_tests.log" 2>&1
  echo "moe gpu tests: exit $?; $(tail -1 "$OUT/moe_gpu_tests.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/moe_gpu_tests.log" | head -20 ;;
esac
case " ${PARTS:-kernels} " in *" engine "*)
  echo "| run | result | against the bound |" | tee -a "$OUT/summary.md"
  echo "|---|---|---|" | tee -a "$OUT/summary.md"
  run A_qwen3-30b-a3b --shape qwen3-30b-a3b
  run b1_qwen3-30b-a3b --shape qwen3-30b-a3b --batch1
  run A_mixtral-8x7b --shape mixtral-8x7b
  run A_llama-3.1-8b --shape llama-3.1-8b ;;
esac
case " ${PARTS:-kernels} " in *" fp8 "*)
  RUN_TIMEOUT="${RUN_TIMEOUT_FP8:-300}"
  echo "| run | result | against the bound |" | tee -a "$OUT/summary.md"
  echo "|---|---|---|" | tee -a "$OUT/summary.md"
  run A_qwen3-30b-a3b_fp8 --shape qwen3-30b-a3b --quantization fp8 ;;
esac
