#!/usr/bin/env bash
# gpt-oss on one H200 (issue 36), in one command that ends within DEADLINE seconds; results under $OUT:
#
#   PARTS="tests kernels bench" WHEEL_DIR=.whl_min bash benchmarks/gpu_gpt_oss.sh
#   (carry .whl_min from `fetch_server_wheels.sh --test --min`: transformers 5.25 for the HF comparisons)
#
# tests:   the gpu tests of the sink variants (Triton against the references, Hopper against Triton), the MoE
#          kernel's gpt-oss and MXFP4 variants at the real layer shapes, and the engine on the GPU against HF for
#          gpt-oss (float and MXFP4 checkpoints).
# kernels: benchmarks/bench_moe.py's gpt-oss rows (the MXFP4 MoE layer of 20b / 120b: the grouped GEMMs, and the
#          decode kernels up to 16 tokens).
# bench:   batch-1 decode on gpt-oss-20b beside llama-3.1-8b, and workload A on gpt-oss-20b and gpt-oss-120b,
#          against their bounds (random MXFP4 weights drawn on the device: --load-format dummy). SHAPES narrows.
DEADLINE_DEFAULT=570
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-tests kernels bench}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"


case " $PARTS " in *" tests "*)
  echo "== gpu tests ($(left) s left)"
  timeout "$(cap 200)" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-\
    tests/kernels/test_kernel_attention.py tests/kernels/test_kernel_decode_sm90_gpu.py \
    tests/kernels/test_kernel_prefill_sm90_gpu.py tests/kernels/test_kernel_moe_gpu.py \
    tests/engine/test_engine_gpu.py tests/model/test_gpt_oss.py} -k "${TEST_FILTER:-sink or gpt_oss or mxfp4}" 2>&1 \
    | tail -25 | tee "$OUT/gpu_tests.log" ;;
esac
case " $PARTS " in *" bench "*)
  for shape in ${SHAPES:-gpt-oss-20b llama-3.1-8b}; do bench "batch1_$shape" --shape "$shape" --batch1; done
  for shape in ${SHAPES:-gpt-oss-20b gpt-oss-120b}; do bench "workload_a_$shape" --shape "$shape"; done ;;
esac

case " $PARTS " in *" kernels "*)
  echo "== bench_moe.py ($(left) s left)"
  timeout "$(cap 120)" python3 benchmarks/bench_moe.py --only gpt-oss-20b,gpt-oss-120b \
    > "$OUT/bench_moe.log" 2>&1 || echo "   exit $?; $(tail -2 "$OUT/bench_moe.log")"  # writes $OUT/moe.md
  cat "$OUT/moe.md" 2>/dev/null ;;
esac
bench_table gpt_oss.md
echo "done in $(( SECONDS - START )) s"
