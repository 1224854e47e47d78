#!/usr/bin/env bash
# Speculative decoding on one H200 (issue 38), in one command that ends within DEADLINE seconds; tables under $OUT:
#
#   PARTS="tests verify pair batch" WHEEL_DIR=.whl_min bash benchmarks/gpu_spec.sh
#
# tests:  the speculative-decoding tests on the GPU (Triton kernels, CUDA graphs: greedy output equal to HF's).
# verify: one request's step scoring its last token and k drafts against a plain decode step (llama-3.1-8b, random
#         weights): the issue's target is ≤ 1.15× at k + 1 = 4.
# pair:   `minfer train` trains a larger model of the built-in model's tokenizer for TRAIN_S seconds (default 150),
#         then batch-1 decode on held-out stdlib code: no speculation, the built-in model drafting, n-gram.
# batch1: batch-1 decode on the shape with and without n-gram drafts (a repeated prompt; acceptance reported).
# batch:  64 requests with and without speculation (the default disable_by_batch_size rule, and always on).
DEADLINE_DEFAULT=570
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-verify pair batch1 batch}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"

case " $PARTS " in *" tests "*)
  echo "== gpu tests ($(left) s left)"
  timeout "$(cap 200)" "$PY" -m pytest -q -p no:cacheprovider -rf tests/engine/test_speculative.py \
    -k "greedy_equals and (default or preempt)" 2>&1 | tail -8 | tee "$OUT/gpu_tests.log" ;;
esac
case " $PARTS " in *" verify "*)
  echo "== verify cost ($(left) s left)"
  timeout "$(cap 150)" "$PY" benchmarks/bench_spec.py verify --shape "${SHAPE:-llama-3.1-8b}" 2>&1 | tail -8 ;;
esac
case " $PARTS " in *" pair "*)
  echo "== train the target ($(left) s left)"
  timeout "$(cap $(( ${TRAIN_S:-150} + 90 )))" "$PY" -m minfer.cli train --tokenizer minfer/assets/builtin-model \
    --hidden-size 768 --layers 12 --heads 12 --kv-heads 4 --intermediate-size 2048 --device cuda \
    --max-time "${TRAIN_S:-150}" --out /tmp/spec-target > "$OUT/train.log" 2>&1 || echo "   train exit $?"
  tail -3 "$OUT/train.log"
  echo "== the pair ($(left) s left)"
  timeout "$(cap 150)" "$PY" benchmarks/bench_spec.py pair --target /tmp/spec-target 2>&1 | tail -8 ;;
esac
case " $PARTS " in *" batch1 "*)
  echo "== batch 1, n-gram ($(left) s left)"
  timeout "$(cap 120)" "$PY" benchmarks/bench_spec.py batch1 --shape "${SHAPE:-llama-3.1-8b}" 2>&1 | tail -6 ;;
esac
case " $PARTS " in *" batch "*)
  echo "== batch 64 ($(left) s left)"
  timeout "$(cap 150)" "$PY" benchmarks/bench_spec.py batch --shape "${SHAPE:-llama-3.1-8b}" --batch 64 2>&1 | tail -8 ;;
esac
echo "done in $(( SECONDS - START )) s"
