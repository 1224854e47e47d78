#!/usr/bin/env bash
# Qwen3.5 on one H200 (issue 37), in one command that ends within DEADLINE seconds; results under $OUT:
#
#   PARTS="tests bench kernels" WHEEL_DIR=.whl_min bash benchmarks/gpu_qwen3_5.sh
#   (carry .whl_min from `fetch_server_wheels.sh --test --min`: transformers 5.25 for the HF comparisons)
#
# tests:   the Gated DeltaNet kernels' gpu tests (9B shapes, CUDA-graph decode) and the engine on the GPU against
#          HF for qwen3_5 (Triton kernels, the state cache in the decode graphs).
# bench:   batch-1 decode and workload A on qwen3.5-9b against their bounds (weights + the state, read and written
#          every token), random weights drawn on the device (--load-format dummy).
# kernels: benchmarks/bench_gated_delta.py (decode and prefill against the bytes / FLOPs they move).
DEADLINE_DEFAULT=570
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-tests bench kernels}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"


case " $PARTS " in *" tests "*)
  echo "== gpu tests ($(left) s left)"
  timeout "$(cap 150)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf ${TESTS:-tests/kernels/test_kernel_gated_delta.py \
    tests/engine/test_engine_gpu.py tests/model/test_qwen3_5.py} -k "${TEST_FILTER:-gated or conv or qwen3_5}" 2>&1 \
    | tail -30 | tee "$OUT/gpu_tests.log" ;;
esac
case " $PARTS " in *" bench "*)
  bench batch1_qwen3.5-9b --shape qwen3.5-9b --batch1
  bench workload_a_qwen3.5-9b --shape qwen3.5-9b ;;
esac
case " $PARTS " in *" kernels "*)
  echo "== bench_gated_delta.py ($(left) s left)"
  timeout "$(cap 120)" python3 benchmarks/bench_gated_delta.py > "$OUT/bench_gated_delta.log" 2>&1 \
    || echo "   exit $?; $(tail -2 "$OUT/bench_gated_delta.log")"
  cat "$OUT/gated_delta.md" 2>/dev/null ;;
esac
bench_table qwen3_5.md
echo "done in $(( SECONDS - START )) s"
