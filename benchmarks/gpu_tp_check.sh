#!/usr/bin/env bash
# Tensor parallelism's checks on one GPU machine (issue: tensor parallelism over torch.distributed), in
# parts that each fit one device call (results under $OUT):
#   PARTS=tests    the gpu-marked suite (tp=1 unchanged; the tp=2 GPU test runs where 2+ GPUs are visible)
#                  and the step channel's cost on this host's cores (benchmarks/tp_channel.py)
#   PARTS=ab OLD=<folder or commit>   tp=1 must not regress: benchmarks/ab_compare.sh, batch 1 on llama-3.2-1b
#                  and workload A on qwen3-0.6b, alternating new/old (ROUNDS, A_ROUNDS)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"
case " ${PARTS:-tests} " in *" tests "*)
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests -rs > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?; $(tail -1 "$OUT/gpu_tests.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | head -20
  timeout 120 python3 benchmarks/tp_channel.py | tee "$OUT/tp_channel.md" ;;
esac
case " ${PARTS:-tests} " in *" ab "*)
  OUT="$OUT/ab" ROUNDS="${ROUNDS:-3}" A_ROUNDS="${A_ROUNDS:-2}" SHAPES=qwen3-0.6b bash benchmarks/ab_compare.sh "${OLD:?OLD=<folder or commit>}"
  cat "$OUT/ab/summary.md" ;;
esac
