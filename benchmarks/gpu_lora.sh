#!/usr/bin/env bash
# Multi-LoRA serving on one H200 (issue 39), in one command that ends within DEADLINE seconds; tables under $OUT:
#
#   PARTS="tests adapters kernels workload batch1" bash benchmarks/gpu_lora.sh
#
# tests:    the LoRA kernels' gpu tests (llama-3.1-8b's layers in bf16, decode and prefill steps, CUDA-graph
#           replays with new slots), and the gpu-marked LoRA tests of tests/lora (TESTS overrides the list).
# adapters: eight random rank-16 PEFT adapters for the shape in /tmp/minfer-lora, each read back by the engine's
#           loader (the engine parts write them too when this part is skipped).
# kernels:  add_lora (shrink + expand) per fused layer at T = 1, 8, 64, 256 over 1 and 8 adapters, against the
#           layer's base linear, both as CUDA-graph replays; the grouping's cost once a step.
# workload: workload A on the shape (random weights, --load-format dummy) with LoRA off, then enable_lora with
#           no adapter, 1 adapter on every request and 8 round robin (max_loras=8); targets 90% / 85% of off.
# batch1:   batch-1 greedy decode, LoRA off against one adapter (target 90%), tokens compared.
# workload and batch1 share one run of bench_lora.py engine (two engines: LoRA off, LoRA on).
# LORA_ARGS: more arguments for every bench_lora.py run (a CPU dry run of this script: "--tiny --num-prompts 8").
DEADLINE_DEFAULT=570
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-tests adapters kernels workload batch1}"
SHAPE="${SHAPE:-llama-3.1-8b}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"

case " $PARTS " in *" tests "*)
  # -m gpu: only the gpu-marked tests of tests/lora and of any engine LoRA test file
  tests="${TESTS:-tests/kernels/test_lora_kernels_gpu.py $(ls -d tests/lora tests/engine/*lora*.py 2>/dev/null \
    | tr '\n' ' ')}"
  echo "== gpu tests: $tests ($(left) s left)"
  # shellcheck disable=SC2086  # the list splits into files
  timeout "$(cap 140)" "$PY" -m pytest -q -p no:cacheprovider -rf -m gpu $tests 2>&1 | tail -12 \
    | tee "$OUT/gpu_tests_lora.log" ;;
esac
# shellcheck disable=SC2086  # LORA_ARGS splits into arguments
case " $PARTS " in *" adapters "*)
  echo "== adapters ($(left) s left)"
  timeout "$(cap 60)" "$PY" benchmarks/bench_lora.py adapters --shape "$SHAPE" ${LORA_ARGS:-} 2>&1 | tail -4 ;;
esac
case " $PARTS " in *" kernels "*)
  echo "== add_lora against the base linear ($(left) s left)"
  timeout "$(cap 100)" "$PY" benchmarks/bench_lora.py kernels --shape "$SHAPE" ${LORA_ARGS:-} 2>&1 | tail -60 ;;
esac
what=""
case " $PARTS " in *" workload "*) what="workload" ;; esac
case " $PARTS " in *" batch1 "*) what="${what:+$what,}batch1" ;; esac
if [ -n "$what" ]; then
  echo "== engine: $what ($(left) s left)"
  timeout "$(cap 330)" "$PY" benchmarks/bench_lora.py engine --shape "$SHAPE" --what "$what" ${LORA_ARGS:-} \
    > "$OUT/lora_engine.log" 2>&1 || echo "   exit $? (124: cut by the time limit); $(grep -E 'Error' \
    "$OUT/lora_engine.log" | tail -2)"
  grep -E "^\|| workload A| batch 1" "$OUT/lora_engine.log"
fi
echo "done in $(( SECONDS - START )) s"
