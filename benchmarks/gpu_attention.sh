#!/usr/bin/env bash
# Attention kernels on one H200 (issue 25), in one device call that ends within ~9.5 minutes (DEADLINE s):
#
#   PARTS="tests kernels" bash benchmarks/gpu_attention.sh
#
# tests:   the Hopper kernels against the float64 reference and the Triton kernels (pytest -m gpu)
#                                                                        -> $OUT/attention_tests.log
# kernels: benchmarks/bench_kernels.py --only prefill,decode over bf16 / int8 / fp8 caches, with SDPA on
#          contiguous K/V as the peer in the same run                    -> $OUT/kernels.md
# e2e:     workload A on qwen3-0.6b with an int8 cache, Hopper kernels off (MINFER_SM90_ATTENTION=0) and on
#                                                                        -> $OUT/attention_e2e.log
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
PARTS="${PARTS:-tests kernels}"
DEADLINE="${DEADLINE:-560}"; START=$SECONDS
left() { echo $(( DEADLINE - (SECONDS - START) )); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 5 ? l : 5) : $1 )); }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"

case " $PARTS " in *" tests "*)
  echo "== tests ($(left) s left)"
  timeout "$(cap 200)" python3 -m pytest -q -p no:cacheprovider -m gpu -rfs -x ${TESTS:-tests/kernels/test_kernel_prefill_sm90_gpu.py} \
    > "$OUT/attention_tests.log" 2>&1; echo "   exit $?; $(tail -1 "$OUT/attention_tests.log")"
  grep -E "^FAILED|^E " "$OUT/attention_tests.log" | cut -c1-240 | head -30 ;;
esac
case " $PARTS " in *" kernels "*)
  echo "== kernels ($(left) s left)"
  OUT="$OUT" timeout "$(cap 300)" python3 benchmarks/bench_kernels.py --only "${ONLY:-prefill,decode}" \
    --kv-dtypes "${KV_DTYPES:-auto,int8,fp8_e4m3}" > "$OUT/kernels.log" 2>&1 || echo "   exit $? (124: cut by the time limit)"
  grep -E "^\| (prefill|decode)|check|FAIL|Error" "$OUT/kernels.log" | head -60 ;;
esac
echo "done after $(( SECONDS - START )) s"
