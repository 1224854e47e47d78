#!/usr/bin/env bash
# Attention kernels on one H200 (issue 25), in one device call that ends within ~9.5 minutes (DEADLINE s):
#
#   PARTS="tests kernels" bash benchmarks/gpu_attention.sh
#   PARTS="sweep e2e serve" bash benchmarks/gpu_attention.sh     # serve needs .whl carried (fetch_server_wheels.sh)
#
# tests:   the Hopper kernels against the float64 reference and the Triton kernels, staged 8-bit prefill (pytest -m gpu)
#                                                                        -> $OUT/attention_tests.log
# kernels: benchmarks/bench_kernels.py --only prefill,decode over bf16 / int8 / fp8 caches, with SDPA on
#          contiguous K/V as the peer in the same run                    -> $OUT/kernels.md
# sweep:   benchmarks/sweep_attention_sm90.py over the 8-bit variants (SWEEP_VARIANTS)  -> $OUT/sweep_*.md
# dsweep:  benchmarks/sweep_decode_sm90.py at B=64 x 4k and B=1 x 32k (variants: DSWEEP_VARIANTS16, DSWEEP_VARIANTS8)
#                                                                        -> $OUT/dsweep_*.md
# e2e:     workload A on qwen3-0.6b with an int8 cache, the Hopper kernels off (MINFER_SM90_ATTENTION=0) and on
#                                                                        -> $OUT/wa_int8_sm{0,1}.json
# serve:   llama-3.1-8b (weights drawn on the GPU), `minfer bench-serve` at 256 clients, off and on
#                                                                        -> $OUT/serve_sm{0,1}/results.json
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-tests kernels}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"

case " $PARTS " in *" tests "*)
  echo "== tests ($(left) s left)"
  timeout "$(cap ${TESTS_CAP:-200})" python3 -m pytest -q -p no:cacheprovider -m gpu -rfs -x ${TESTS:-tests/kernels/test_kernel_prefill_sm90_gpu.py tests/kernels/test_kernel_decode_sm90_gpu.py tests/kernels/test_kernel_kv_stage.py} \
    > "$OUT/attention_tests.log" 2>&1; echo "   exit $?; $(tail -1 "$OUT/attention_tests.log")"
  grep -E "^FAILED|^E " "$OUT/attention_tests.log" | cut -c1-240 | head -30 ;;
esac
case " $PARTS " in *" kernels "*)
  echo "== kernels ($(left) s left)"
  OUT="$OUT" timeout "$(cap ${KERNELS_CAP:-300})" python3 benchmarks/bench_kernels.py --only "${ONLY:-prefill,decode}" \
    --kv-dtypes "${KV_DTYPES:-auto,int8,fp8_e4m3}" > "$OUT/kernels.log" 2>&1 || echo "   exit $? (124: cut by the time limit)"
  grep -E "^\| (prefill|decode|stage)|check|FAIL|Error" "$OUT/kernels.log" | head -60 ;;
esac
case " $PARTS " in *" sweep "*)
  for kd in ${SWEEP_KV:-int8 fp8_e4m3}; do
    echo "== sweep $kd ($(left) s left)"
    timeout "$(cap 120)" python3 benchmarks/sweep_attention_sm90.py --t 8192 2048 --kv-dtype "$kd" \
      --variants "${SWEEP_VARIANTS:-128x128x2x2,128x64x4x3,128x64x3x3}" > "$OUT/sweep_$kd.md" 2>&1 || echo "   exit $?"
    tail -8 "$OUT/sweep_$kd.md"
  done ;;
esac
case " $PARTS " in *" dsweep "*)
  for kd in ${DSWEEP_KV:-auto int8 fp8_e4m3}; do
    echo "== decode sweep $kd ($(left) s left)"
    variants="${DSWEEP_VARIANTS16:-shipped}"; [ "$kd" != auto ] && variants="${DSWEEP_VARIANTS8:-shipped}"
    { timeout "$(cap 90)" python3 benchmarks/sweep_decode_sm90.py --kv-dtype "$kd" --variants "$variants" --splits 1
      timeout "$(cap 60)" python3 benchmarks/sweep_decode_sm90.py --kv-dtype "$kd" --batch 1 --ctx 32768 \
        --variants "$variants" --splits ${DSWEEP_SPLITS:-16,33}
    } > "$OUT/dsweep_$kd.md" 2>&1 || echo "   exit $?"
    grep "^|\|Error" "$OUT/dsweep_$kd.md" | grep -v "^| impl\|^|---" | head -24
  done ;;
esac
case " $PARTS " in *" e2e "*)
  for sm in 0 1; do
    echo "== workload A, qwen3-0.6b, int8 cache, MINFER_SM90_ATTENTION=$sm ($(left) s left)"
    MINFER_SM90_ATTENTION=$sm timeout "$(cap 150)" python3 -m minfer.cli -v bench --shape qwen3-0.6b --kv-cache-dtype int8 \
      --quiet --output-json "$OUT/wa_int8_sm$sm.json" > "$OUT/wa_int8_sm$sm.log" 2>&1 || echo "   exit $?"
    grep -E "\"output_tok_s|Error" "$OUT/wa_int8_sm$sm.log" | head -3
  done ;;
esac
case " $PARTS " in *" serve "*)
  python3 -c "from pathlib import Path; from minfer.benchmark.shapes import write_shape_config as w; \
w('llama-3.1-8b', Path('/tmp/minfer-shapes/llama-3.1-8b-dummy'))"
  for sm in 0 1; do
    echo "== serve llama-3.1-8b, 256 clients, MINFER_SM90_ATTENTION=$sm ($(left) s left)"
    MINFER_SM90_ATTENTION=$sm python3 -m minfer.cli serve --model /tmp/minfer-shapes/llama-3.1-8b-dummy --load-format dummy \
      --skip-tokenizer-init --max-model-len 4096 --max-num-seqs 256 --port 8011 --no-access-log \
      --uvicorn-log-level warning > "$OUT/server_sm$sm.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 90); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 2; done
    timeout "$(cap 150)" python3 -m minfer.cli bench-serve --base-url http://127.0.0.1:8011 --concurrency 256 \
      --output-dir "$OUT/serve_sm$sm" > "$OUT/serve_sm$sm.log" 2>&1 || echo "   exit $?"
    tail -3 "$OUT/serve_sm$sm.log"
    python3 -c "import json,sys; r=json.load(open('$OUT/serve_sm$sm/results.json')); print(json.dumps(r, indent=None)[:1500])" \
      2>/dev/null | head -c 1500; echo
    kill "$SERVER"; wait "$SERVER" 2>/dev/null
  done ;;
esac
echo "done after $(( SECONDS - START )) s"
