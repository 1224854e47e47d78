"""FP8 against bfloat16 greedy decoding on the GPU: the share of identical tokens over a workload.

The built-in model (trained, so its distributions have real margins, unlike random weights) runs the
same prompts greedily in bfloat16 and with online FP8 weights (per channel, the FP8 tensor-core path).
Two figures:

- teacher-forced top-1 agreement: over the bf16 run's own outputs (prompt + generated text fed to both
  models as a prompt), the share of positions whose most likely next token is the same: per-step
  agreement, free of the divergence cascade;
- free-running: the share of output positions equal between the runs, and the share of outputs that
  are identical in full.

    python3 benchmarks/fp8_agreement.py [--prompts 64] [--tokens 64]   # writes $OUT/fp8_agreement.md
"""
from __future__ import annotations

import argparse
import os

import torch

from minfer import LLM, SamplingParams
from minfer.train.corpus import heldout_files


def prompts(n: int, words: int = 24) -> list[str]:
    """``n`` held-out text openings of ``words`` words each."""
    out = []
    for path in heldout_files():
        text = " ".join(open(path, encoding="utf-8").read().split())
        for start in range(0, max(len(text.split()) - words, 1), 400):
            out.append(" ".join(text.split()[start:start + words]))
            if len(out) == n:
                return out
    return out


def run(quantization: str | None, texts: list[str], tokens: int) -> tuple[list[list[int]], list[list[int]], LLM]:
    llm = LLM(dtype="bfloat16", quantization=quantization, skip_tokenizer_init=False)
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs], llm


def top1(llm: LLM, sequences: list[list[int]]) -> list[list[int]]:
    """Each position's most likely next token (prompt logprobs, k=1) over whole token sequences."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    return [[max(e, key=e.get) for e in o.prompt_logprobs[1:]] for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    texts = prompts(args.prompts)
    ids, bf16, llm = run(None, texts, args.tokens)
    sequences = [p + o for p, o in zip(ids, bf16)]
    ref_top = top1(llm, sequences)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _, fp8, llm = run("fp8", texts, args.tokens)
    fp8_top = top1(llm, sequences)
    same_steps = sum(a == b for r, f in zip(ref_top, fp8_top) for a, b in zip(r, f))
    steps = sum(len(r) for r in ref_top)
    same_free = sum(a == b for r, f in zip(bf16, fp8) for a, b in zip(r, f))
    total = sum(len(r) for r in bf16)
    whole = sum(r == f for r, f in zip(bf16, fp8))
    table = "\n".join([
        f"FP8 (online, per channel) vs bf16, built-in model, {len(texts)} prompts x {args.tokens} greedy tokens, "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}",
        "",
        "| measure | agreement |",
        "|---|---:|",
        f"| teacher-forced top-1, every position of prompt + output | {100 * same_steps / steps:.2f}% ({steps} positions) |",
        f"| free-running greedy, output positions | {100 * same_free / total:.2f}% ({total} tokens) |",
        f"| free-running greedy, whole outputs identical | {whole} / {len(bf16)} |",
    ])
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_agreement.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
