#!/usr/bin/env bash
# FP8 weights on one H200 (issue: FP8 weights on Hopper), in parts that each fit one device call:
#   PARTS=kernels   the FP8 kernel table (benchmarks/bench_fp8.py) and the gpu tests of the FP8 path
#   PARTS=engine    minfer bench on llama-3.1-8b: workload A bf16 / fp8 / fp8 + int8 KV, batch 1 bf16 / fp8,
#                   prefill-heavy (64 x 2,048 in, 1 out) bf16 / fp8, in the same call
#   PARTS=small     workload A on qwen3-0.6b and llama-3.2-1b, bf16 and fp8
# Results (JSON, logs, a summary table) under $OUT.
source "$(dirname "$0")/device_call.sh"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"
run() {  # name, then minfer bench arguments
  local name=$1; shift
  timeout 240 python3 -m minfer.cli bench --quiet --output-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 \
    || echo "   $name: exit $? (124: cut by the time limit); $(tail -2 "$OUT/$name.log")"
  python3 - "$OUT/$name.json" "$name" <<'PY' | tee -a "$OUT/summary.md"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    sys.exit(print(f"| {sys.argv[2]} | failed |"))
b = d.get("batch1")
if b:
    print(f"| {sys.argv[2]} | batch 1: {b['decode_tok_s']:,.1f} tok/s | {100 * b['share_of_bound']:.1f}% of {b['bound_tok_s']:,.0f} "
          f"({b['weights_gib']} GiB read per token) |")
else:
    print(f"| {sys.argv[2]} | {d['output_tok_s']:,.1f} output tok/s, {d['total_tok_s']:,.1f} total | "
          f"{100 * d['share_of_bound']:.1f}% of bound; {d['num_kv_blocks']} KV blocks, {d['num_preemptions']} preemptions |")
PY
}
case " ${PARTS:-kernels} " in *" kernels "*)
  timeout 240 python3 benchmarks/bench_fp8.py | tee "$OUT/bench_fp8.md"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_fp8_gpu.py tests/kernels/test_kernel_fp8.py -rs \
    > "$OUT/fp8_gpu_tests.log" 2>&1; echo "fp8 gpu tests: exit $?; $(tail -1 "$OUT/fp8_gpu_tests.log")"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/fp8_gpu_tests.log" | head -20 ;;
esac
case " ${PARTS:-kernels} " in *" engine "*)
  S="--shape llama-3.1-8b"
  run A_8b_bf16 $S
  run A_8b_fp8 $S --quantization fp8
  run A_8b_fp8_int8kv $S --quantization fp8 --kv-cache-dtype int8
  run b1_8b_bf16 $S --batch1
  run b1_8b_fp8 $S --batch1 --quantization fp8
  run prefill_8b_bf16 $S --input-len 2048 --output-len 1 --num-prompts 64
  run prefill_8b_fp8 $S --input-len 2048 --output-len 1 --num-prompts 64 --quantization fp8 ;;
esac
case " ${PARTS:-kernels} " in *" small "*)
  for shape in qwen3-0.6b llama-3.2-1b; do
    run "A_${shape}_bf16" --shape "$shape"
    run "A_${shape}_fp8" --shape "$shape" --quantization fp8
  done ;;
esac
