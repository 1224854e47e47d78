#!/usr/bin/env bash
# llama-3.1-8b on one H200, in one command that ends within ~9.5 minutes (DEADLINE seconds):
#
#   PARTS="bench kvquant serve" bash benchmarks/gpu_8b.sh     # results under $OUT (default /tmp/minfer-out)
#   (FORMATS="auto int8" narrows the kvquant part)
#
# bench:   workload A (issue 5; target >= 9,000 output tok/s).
# kvquant: workload A with an 8 GiB KV budget, which bf16 fills (~60 sequences) so it must preempt,
#          once per kv_cache_dtype (issue 7).
# serve:   `minfer serve`, then `minfer bench-serve` at concurrency 1/16/64/256 and at 4 requests/s (issue 6; needs
#          fastapi/uvicorn/pydantic: `bash benchmarks/fetch_server_wheels.sh` here, and carry .whl).
# The 16 GB random-weight checkpoint goes to /tmp/minfer-shapes (reused while the machine stays warm).
source "$(dirname "$0")/device_call.sh"
PARTS="${PARTS:-bench kvquant serve}"
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log -1 --format=%h 2>/dev/null; } | tee "$OUT/gpu.txt"
python3 -c "from pathlib import Path; from minfer.benchmark.shapes import write_random_checkpoint as w; \
w('llama-3.1-8b', Path('/tmp/minfer-shapes/llama-3.1-8b'), device='cuda')"
echo "checkpoint ready after $(( SECONDS - START )) s"

bench() {  # name, then minfer bench arguments
  local name=$1; shift
  echo "== $name ($(left) s left)"
  timeout "$(cap 200)" python3 -m minfer.cli -v bench --shape llama-3.1-8b --quiet --output-json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1 || echo "   exit $? (124: cut by the time limit)"
  grep -E "KV cache:|\"output_tok_s|preemptions|share_of_bound|Error" "$OUT/$name.log" | head -5
}
case " $PARTS " in *" bench "*) bench workload_a_llama-3.1-8b ;; esac
case " $PARTS " in *" kvquant "*)
  for fmt in ${FORMATS:-auto int8 fp8_e4m3 fp8_e5m2}; do
    bench "kv8g_$fmt" --kv-cache-memory-bytes 8589934592 --kv-cache-dtype "$fmt"
  done ;;
esac
case " $PARTS " in *" serve "*)
  echo "== bench-serve ($(left) s left)"
  python3 -m minfer.cli serve --model /tmp/minfer-shapes/llama-3.1-8b --skip-tokenizer-init --max-model-len 4096 \
    --max-num-seqs 256 --port 8011 --no-access-log --uvicorn-log-level warning > "$OUT/server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 90); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 2; done
  echo "server up after $(( SECONDS - START )) s"
  timeout "$(cap 300)" python3 -m minfer.cli bench-serve --base-url http://127.0.0.1:8011 --concurrency 1,16,64,256 \
    --output-dir "$OUT/serve" > "$OUT/serve.log" 2>&1 || echo "   exit $?"
  tail -8 "$OUT/serve.log"
  timeout "$(cap 120)" python3 -m minfer.cli bench-serve --base-url http://127.0.0.1:8011 --request-rate 4 \
    --num-prompts 120 --output-dir "$OUT/serve_rate4" > "$OUT/serve_rate4.log" 2>&1 || echo "   exit $?"
  tail -4 "$OUT/serve_rate4.log"
  kill "$SERVER"; wait "$SERVER" 2>/dev/null ;;
esac
echo "done in $(( SECONDS - START )) s"
