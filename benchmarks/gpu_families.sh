#!/usr/bin/env bash
# The 2026 dense families on one H200 (issue 35), in one command that ends within DEADLINE seconds:
#
#   PARTS="tests bench batch1 hybrid" WHEEL_DIR=.whl_min bash benchmarks/gpu_families.sh   # results under $OUT
#   (carry .whl_min from `fetch_server_wheels.sh --test --min`: transformers 5.25 for the gpu tests)
#
# tests:  (TESTS: the files, TEST_FILTER: a -k expression) the gpu tests of the windowed / soft-capped attention kernels (Triton and Hopper) and the engine's
#         HF agreement on the GPU for every architecture (transformers 5.25 from .whl: carry it).
# bench:  workload A on llama-3.1-8b, gemma-3-27b and phi-4 (same call, against each one's bound; SHAPES narrows).
# batch1: batch-1 decode on gemma-3-12b and phi-4 (target >= 85% of the weight-bandwidth bound; B1 narrows).
#         Random weights drawn on the device (--load-format dummy).
# profile: torch.profiler over batch-1 decode steps of B1 (dev/profile_steps.py: the top kernels by device time).
# hybrid: benchmarks/hybrid_kv.py on gemma-3-27b at 32k: sequences that fit and a long-context workload's
#         throughput, hybrid KV cache against a full-length cache for every layer.
DEADLINE_DEFAULT=570
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-tests bench batch1 hybrid}"  # and profile, on request
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"
python3 -c "import transformers; print('transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"


case " $PARTS " in *" tests "*)
  echo "== gpu tests ($(left) s left)"
  timeout "$(cap 240)" python3 -m pytest -q -m gpu -p no:cacheprovider -x ${TEST_FILTER:+-k "$TEST_FILTER"} ${TESTS:-tests/kernels/test_kernel_attention.py \
    tests/kernels/test_kernel_decode_sm90_gpu.py tests/kernels/test_kernel_prefill_sm90_gpu.py \
    tests/engine/test_engine_gpu.py} 2>&1 | tail -25 | tee "$OUT/gpu_tests.log" ;;
esac
case " $PARTS " in *" bench "*)
  for shape in ${SHAPES:-llama-3.1-8b gemma-3-27b phi-4}; do bench "workload_a_$shape" --shape "$shape"; done ;;
esac
case " $PARTS " in *" batch1 "*)
  for shape in ${B1:-gemma-3-12b phi-4}; do bench "batch1_$shape" --shape "$shape" --batch1; done ;;
esac
case " $PARTS " in *" profile "*)
  echo "== profile batch 1, ${B1:-gemma-3-12b} ($(left) s left)"
  timeout "$(cap 150)" python3 dev/profile_steps.py --shape "${B1:-gemma-3-12b}" --batch1 --steps 50 --load-format dummy \
    --out "$OUT/profile_batch1.txt" > "$OUT/profile_batch1.log" 2>&1 || echo "   exit $?"
  head -40 "$OUT/profile_batch1.txt" 2>/dev/null ;;
esac
case " $PARTS " in *" hybrid "*)
  echo "== hybrid KV cache ($(left) s left)"
  timeout "$(cap 300)" python3 benchmarks/hybrid_kv.py --shape "${HYBRID_SHAPE:-gemma-3-27b}" --context 32768 \
    --num-prompts "${HYBRID_PROMPTS:-8}" --output-len 256 --out "$OUT/hybrid_kv.json" > "$OUT/hybrid_kv.log" 2>&1 \
    || echo "   exit $?"
  tail -30 "$OUT/hybrid_kv.log" ;;
esac

bench_table families.md
echo "done in $(( SECONDS - START )) s"
