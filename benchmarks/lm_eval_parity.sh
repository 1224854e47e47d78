#!/usr/bin/env bash
# lm-evaluation-harness against the server (--model local-completions: echo + logprobs requests) and against
# HF transformers (--model hf) on the same weights, on two tiny local tasks (benchmarks/lm_eval_tiny/: a
# multiple-choice task scored by loglikelihood, a rolling-loglikelihood perplexity task). Offline, CPU.
#
#   pip install "lm_eval[api]" accelerate peft   # (lm_eval itself does not pull torch)
#   bash benchmarks/lm_eval_parity.sh [MODEL_DIR]    # default: the built-in model
#
# add_bos_token=True: local-completions tokenizes the text itself and sends token ids; without it the
# ids lack the BOS that HF's tokenizer (and --model hf, which sets it from the tokenizer) puts first,
# and every loglikelihood differs.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-minfer/assets/builtin-model}
PORT=${PORT:-8765}
OUT=${OUT:-/tmp/minfer-lm-eval}
TASKS=minfer_tiny_mc,minfer_tiny_ppl
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

python -c "from minfer.server.run import run_server; run_server('$MODEL', {}, port=$PORT, served_model_names=['tiny'], access_log=False, log_level='warning')" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done

lm_eval --model local-completions --include_path benchmarks/lm_eval_tiny --tasks "$TASKS" \
  --model_args "model=tiny,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL,tokenizer_backend=huggingface,add_bos_token=True,num_concurrent=1,max_retries=1" \
  --output_path "$OUT/server" 2>&1 | tee "$OUT/server.log" | grep -E "^\|" || tail -20 "$OUT/server.log"
lm_eval --model hf --include_path benchmarks/lm_eval_tiny --tasks "$TASKS" \
  --model_args "pretrained=$MODEL,dtype=float32,add_bos_token=True" --device cpu --batch_size 1 \
  --output_path "$OUT/hf" 2>&1 | grep -E "^\|"
