#!/usr/bin/env bash
# Where a step's time goes, on one H200 (~5 minutes), text under $OUT (default /tmp/minfer-out):
#   torch.profiler over steady-state decode steps (qwen3-0.6b workload A; llama-3.2-1b batch 1), over workload A's
#   first, prompt-carrying (eager) steps, and the host cost of one kernel launch per kind.
#   bash dev/gpu_profiles.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/minfer-out}"; mkdir -p "$OUT"
echo "== profile decode steps, qwen3-0.6b workload A"
timeout 100 python3 dev/profile_steps.py --shape qwen3-0.6b --out "$OUT/profile_qwen3-0.6b.txt" 2>&1 \
  | grep -v Warn | head -14
echo "== profile prompt-carrying steps"
timeout 80 python3 dev/profile_steps.py --shape qwen3-0.6b --prompt-steps --steps 6 \
  --out "$OUT/profile_qwen3-0.6b_prompt_steps.txt" 2>&1 | grep -v Warn | head -20
echo "== launch overhead"
timeout 40 python3 dev/launch_overhead.py 2>&1 | tee "$OUT/launch_overhead.txt"
echo "== profile batch 1, llama-3.2-1b"
timeout 80 python3 dev/profile_steps.py --shape llama-3.2-1b --batch1 --steps 50 \
  --out "$OUT/profile_llama-3.2-1b_batch1.txt" 2>&1 | grep -v Warn | head -30
