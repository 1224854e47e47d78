#!/usr/bin/env bash
# A/B on one GPU machine: this working tree against commit $1 (or a folder holding an old tree), alternating in separate
# processes, the side that goes first alternating by round (same machine, same minutes, so host and clock noise hit
# both), logs and a summary under $OUT.
#   batch 1 (llama-3.2-1b, batch1.py: tok/s over 512 tokens and the decode graph's replay time), $ROUNDS rounds
#   workload A on $SHAPES (minfer bench; shape:fp8 adds --quantization fp8), $A_ROUNDS rounds (default 1; 0 skips it)
#   batch 1 on $B1_SHAPES (minfer bench --batch1, weights drawn on the GPU: the MoE shapes do not fit the disk),
#   $B1_ROUNDS rounds (default 1; none unless B1_SHAPES is set)
# Usage: OUT=/tmp/ab ROUNDS=2 A_ROUNDS=2 SHAPES=qwen3-0.6b benchmarks/ab_compare.sh 0724a14
# A machine whose copy of .git lacks the commit takes a folder: `git archive C | tar -x -C .ab_old`, carried along.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT="${OUT:-/tmp/minfer-ab}"; mkdir -p "$OUT"; NEW="$PWD"; OLD=/tmp/minfer-old
if [ -d "$1" ]; then
  rm -rf "$OLD"; cp -r "$1" "$OLD"
else
  rm -rf "$OLD"; git worktree prune; git worktree add -f "$OLD" "$1" >/dev/null 2>&1 || { echo "no commit $1"; exit 1; }
fi
cp benchmarks/batch1.py "$OLD/benchmarks/"  # today's measurement, old engine (it imports no kernel module)
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; echo "new: $(git rev-parse --short HEAD) + working tree, old: $1"; } | tee "$OUT/summary.md"
order() { if [ $(($1 % 2)) = 1 ]; then echo new old; else echo old new; fi; }  # odd rounds new first, even old
for r in $(seq "${ROUNDS:-2}"); do
  for side in $(order "$r"); do
    dir=$NEW; [ $side = old ] && dir=$OLD
    (cd "$dir" && PYTHONPATH="$dir" timeout 120 python3 benchmarks/batch1.py --output-len 512) 2>&1 \
      | grep -E "^\||Error" | sed "s/^| base |/| batch 1, $side |/" | tee -a "$OUT/summary.md"
  done
done
for r in $(seq "${A_ROUNDS:-1}"); do
 for variant in ${SHAPES:-qwen3-0.6b}; do  # a shape, or shape:fp8 for --quantization fp8
  shape=${variant%%:*}; quant=(); [ "$variant" != "$shape" ] && quant=(--quantization "${variant#*:}")
  name=${variant//:/-}
  for side in $(order "$r"); do
    dir=$NEW; [ $side = old ] && dir=$OLD
    (cd "$dir" && PYTHONPATH="$dir" timeout 200 python3 -m minfer.cli bench --quiet --shape "$shape" "${quant[@]}" \
      --output-json "$OUT/A_${name}_${side}_$r.json") > "$OUT/A_${name}_${side}_$r.log" 2>&1 || echo "exit $?"
    echo "| workload A $variant, $side | $(grep -oE '"output_tok_s": [0-9.]+' "$OUT/A_${name}_${side}_$r.json") |" \
      | tee -a "$OUT/summary.md"
  done
 done
done
for r in $(seq "${B1_ROUNDS:-1}"); do
 for shape in ${B1_SHAPES:-}; do
  for side in $(order "$r"); do
    dir=$NEW; [ $side = old ] && dir=$OLD
    (cd "$dir" && PYTHONPATH="$dir" timeout 200 python3 -m minfer.cli bench --quiet --batch1 --load-format dummy \
      --shape "$shape" --output-json "$OUT/b1_${shape}_${side}_$r.json") > "$OUT/b1_${shape}_${side}_$r.log" 2>&1 \
      || echo "exit $?"
    echo "| batch 1 $shape, $side | $(grep -oE '"decode_tok_s": [0-9.]+' "$OUT/b1_${shape}_${side}_$r.json") |" \
      | tee -a "$OUT/summary.md"
  done
 done
done
