"""Comparing a run with its reference where float32 summation order can flip a rounding: FP8
activations and weights, 8-bit KV codes, tensor-parallel all-reduces, a router's top-k.

Both sides compute the same math, but a sum taken in another order (another CPU's kernels, gloo's
all-reduce, a GEMM of another shape, HF's cached decode against a full forward) moves a value by an ulp,
and where that value sits on an e4m3 rounding boundary it moves by a whole e4m3 step (up to 6%). On the
FP8 test models one such flip in a prompt's prefill moves every later step's logprobs by up to ~0.1
nats, which no fixed float tolerance separates from a bug; a weight scale doubled in one row of one
layer moves them by ~0.26 on average. What separates the two is the error's size against the
quantization's own effect on the model: how far the quantized model's logprobs sit from the
unquantized model's (~0.3 nats on these models).

So ``assert_within_quant_noise`` checks:

- the reference is teacher-forced: its log-probs at each step given *our* tokens, so one parting
  neither leaves the rest of a sequence unchecked nor sets two different continuations side by side;
- where our greedy token is not the reference's, the reference puts its top token less than the mean
  noise above ours (a near-tie at this scale);
- a step's error is the largest |ours - reference| over the tokens we report: their mean must be a
  small share of the mean noise, and the largest under the mean noise.

Two runs of our own engine (tp=2 against tp=1), where only reported top logprobs exist, are compared
by ``assert_runs_agree``: equal tokens until the reference run's top two are a near-tie, close logprobs
until then, nothing after.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_MODELS: dict[str, torch.nn.Module] = {}


def hf_model(model_dir: Path) -> torch.nn.Module:
    """HF transformers' float32 model of a checkpoint folder (compressed-tensors ones decompressed), cached."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _MODELS:
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _MODELS[key]


def teacher_forced(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``model``'s log-probs ``[len(tokens), vocab]`` at each output step, given ``tokens`` before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), -1)


@dataclass
class QuantDistance:
    """Per output step of every sequence: ``errors`` (largest |ours - reference| over the tokens we
    report), ``noise`` (the same between the unquantized model and the reference), and at each step
    where our greedy token is not the reference's argmax, the reference's lead of its top token over
    ours (``partings``: (sequence, step, lead))."""

    errors: list[float]
    noise: list[float]
    partings: list[tuple[int, int, float]]

    @property
    def mean_noise(self) -> float:
        return sum(self.noise) / len(self.noise)

    @property
    def mean_error(self) -> float:
        return sum(self.errors) / len(self.errors)


def quant_distance(outs: list, prompts: list[list[int]], reference: torch.nn.Module,
                   unquantized: torch.nn.Module) -> QuantDistance:
    """Our greedy ``outs`` (``RequestOutput``s with logprobs) against the teacher-forced ``reference``,
    with the ``unquantized`` model's distance from that reference on the same tokens as the scale."""
    dist = QuantDistance([], [], [])
    for seq, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        ref, plain = teacher_forced(reference, prompt, tokens), teacher_forced(unquantized, prompt, tokens)
        for step, (token, reported) in enumerate(zip(tokens, logprobs, strict=True)):
            dist.errors.append(max(abs(v - float(ref[step, t])) for t, v in reported.items()))
            dist.noise.append(max(abs(float(plain[step, t] - ref[step, t])) for t in reported))
            top = int(ref[step].argmax())
            if token != top:
                dist.partings.append((seq, step, float(ref[step, top] - ref[step, token])))
    return dist


def assert_within_quant_noise(outs: list, prompts: list[list[int]], reference: torch.nn.Module,
                              unquantized: torch.nn.Module, mean_share: float = 0.25) -> QuantDistance:
    """Our quantized run sits as close to its reference as a flipped rounding allows: see the module's
    docstring. Measured on the FP8 tests: mean error at most 0.08 of the mean noise (1e-6 where nothing
    flips), largest 0.38 of it; a doubled weight scale in one row: 0.9 and 2.6."""
    dist = quant_distance(outs, prompts, reference, unquantized)
    noise = dist.mean_noise
    assert noise > 0, "the quantized reference equals the unquantized model: nothing is quantized"
    for seq, step, lead in dist.partings:
        assert lead < noise, (f"sequence {seq} parted from the reference at step {step}, where the reference's "
                              f"top token leads ours by {lead:.3f} nats (not a near-tie: mean noise {noise:.3f})")
    assert dist.mean_error <= mean_share * noise, (
        f"mean error {dist.mean_error:.4f} nats over {mean_share} x the mean quantization noise {noise:.4f}",
        sorted(dist.errors)[-5:])
    assert max(dist.errors) < noise, (f"largest error {max(dist.errors):.4f} nats over the mean quantization "
                                      f"noise {noise:.4f}", sorted(dist.errors)[-5:])
    return dist


def run_differences(runs: list, refs: list) -> tuple[list[float], list[tuple[int, int, float]]]:
    """Two runs (``RequestOutput`` lists with top logprobs) of the same greedy requests, step by step while
    their tokens have been equal: the largest logprob difference over the tokens both report, and where
    the tokens part, (sequence, step, the reference run's top-two gap there). After a parting the
    continuations differ and nothing more of that sequence is compared."""
    diffs, partings = [], []
    for seq, (run, ref) in enumerate(zip(runs, refs, strict=True)):
        a, b = run.outputs[0], ref.outputs[0]
        assert len(a.token_ids) == len(b.token_ids), (seq, a.token_ids, b.token_ids)
        for step, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[step], b.logprobs[step]
            shared = [t for t in lb if t in la]  # the top-k sets may differ where ranks below the first tie
            assert shared, (seq, step, la, lb)
            diffs.append(max(abs(la[t] - lb[t]) for t in shared))
            if x != y:
                top = sorted(lb.values(), reverse=True)
                partings.append((seq, step, top[0] - top[1]))
                break
    return diffs, partings


def assert_runs_agree(runs: list, refs: list, tol: float, tie_gap: float) -> int:
    """``run_differences`` within bounds: the same token unless the reference run's top two are within
    ``tie_gap`` nats, and logprobs within ``tol`` while the tokens have been equal. Returns the steps compared."""
    diffs, partings = run_differences(runs, refs)
    for seq, step, gap in partings:
        assert gap < tie_gap, (f"sequence {seq} parted from the reference run at step {step}, where its top two "
                               f"are {gap:.4g} nats apart (near-tie: under {tie_gap:.3g})")
    assert max(diffs) < tol, f"logprobs differ by up to {max(diffs):.3g} (tolerance {tol:.3g}): {diffs}"
    return len(diffs)
