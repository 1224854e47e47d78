"""Speculative decoding on the GPU (issue 38): what a verify step costs, and what drafting buys end to end.

    python3 benchmarks/bench_spec.py verify --shape llama-3.1-8b          # one request: a step verifying k drafts
    python3 benchmarks/bench_spec.py pair --target DIR [--max-tokens 256]  # batch 1: the built-in model drafting
                                                                          # for DIR, n-gram, and no speculation
    python3 benchmarks/bench_spec.py batch1 --shape llama-3.1-8b           # batch 1, n-gram on a repeated prompt
    python3 benchmarks/bench_spec.py batch --shape llama-3.1-8b --batch 64 # a batch with and without speculation
    python3 benchmarks/bench_spec.py eagle --shape llama-3.1-8b            # batch 1: what an EAGLE-3 step costs
    python3 benchmarks/bench_spec.py ceiling --shape llama-3.1-8b          # batch 1 where every draft is right

Each part prints a markdown table and writes it under $OUT (default /tmp/minfer-out). ``verify`` times the
runner's launch + draws of one sequence's step (its last token and k drafts, the decode graph of 1 + k rows)
against a plain decode step, on random weights (``--load-format dummy``); the issue's target is ≤ 1.15× at k+1 = 4.
``pair`` prompts with the first 160 tokens of held-out stdlib files (the email, json and tomllib packages the
built-in model never trained on) and reports decode tok/s and the acceptance counters of each method.
``eagle`` runs batch-1 decode with a random-weight EAGLE-3 head of the shape's width (draft vocabulary 32,000), its
back-off off so that every step drafts: with random weights nothing is accepted, so the time per token is what a
drafting and verifying step costs against a plain one, the break-even point of any head's acceptance.
``ceiling`` measures the other end: the shape's weights drawn at random, then its layers' output projections
(o_proj, down_proj) zeroed and its LM head set to its embedding, so the model repeats its last token forever (a
token's normed embedding is nearest itself); n-gram lookup and an EAGLE-3 head built the same way (fc passing the
last captured layer, its layer adding nothing, its LM head the embedding) then draft what it writes. Every weight
is still read every step, so the times are the shape's; the output is the model's, verified as always.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from minfer import LLM, SamplingParams
from minfer.benchmark.shapes import shape_checkpoint
from minfer.engine.scheduler import SchedulerOutput

OUT = Path(os.environ.get("OUT", "/tmp/minfer-out"))


def _table(name: str, header: list[str], rows: list[list]) -> None:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"spec_{name}.md").write_text(text + "\n")


def verify_cost(shape: str, ks: list[int], iters: int) -> None:
    model = str(shape_checkpoint(shape, Path("/tmp/minfer-shapes"), "dummy"))
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)})
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": list(range(100, 612))}, SamplingParams(max_tokens=3000, temperature=0))
    engine.step()  # the prompt
    seq = engine.scheduler.running[0]
    engine.block_manager.allocate_slots(seq, 1 + max(ks))
    runner = engine.runner
    rows, base = [], None
    for k in [0, *ks]:
        seq.num_scheduled_tokens, seq.spec_token_ids = 1 + k, [7] * k
        batch = SchedulerOutput([seq], 0, 1 + k, speculative=k > 0)
        batch.order()
        times = []
        for i in range(iters + 5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step = runner.launch(batch, None)
            step.sample.result()
            if i >= 5:
                times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        base = base or ms
        rows.append([k + 1, f"{ms:.3f}", f"{ms / base:.3f}"])
    seq.spec_token_ids = []
    _table(f"verify_{shape}", ["tokens scored (k + 1)", "step ms (median)", "× one decode step"], rows)
    llm.shutdown()


def heldout_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    import email
    import json
    import tomllib

    files = sorted(p for pkg in (email, json, tomllib) for p in Path(pkg.__file__).parent.glob("*.py"))
    prompts = []
    for path in files:
        ids = tokenizer.encode(path.read_text())
        if len(ids) > length + 300:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


def pair(target: str, draft: str, k: int, max_tokens: int, n: int) -> None:
    rows = []
    configs = [("none", None), ("draft_model (built-in)", {"method": "draft_model", "model": draft,
                                                           "num_speculative_tokens": k}),
               ("ngram", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4})]
    base = None
    for name, spec in configs:
        llm = LLM(target, speculative_config=spec, max_model_len=1024)  # the built-in model's context
        prompts = heldout_prompts(llm.get_tokenizer(), n, 160)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:  # warm-up: every kernel variant the timed runs meet compiles here
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        tok_s = []
        for p in prompts:  # batch 1: one request at a time
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            m = out.metrics
            tok_s.append((len(out.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time))
        speed = statistics.mean(tok_s)
        base = base or speed
        s = llm.get_stats()
        rate = f"{s['spec_decode_acceptance_rate']:.3f}" if spec else "—"
        per_pos = ", ".join(f"{x:.2f}" for x in s.get("spec_decode_acceptance_rate_per_pos", [])) or "—"
        mean_len = f"{s['spec_decode_mean_acceptance_length']:.2f}" if spec else "—"
        rows.append([name, f"{speed:.1f}", f"{speed / base:.2f}×", rate, mean_len, per_pos])
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    _table("pair", ["speculation", "batch-1 decode tok/s", "speed-up", "acceptance", "tokens per step",
                    "acceptance per position"], rows)


def _batch1_speed(llm: LLM, prompt: dict, params: SamplingParams) -> tuple[list[int], float, dict]:
    """One request after a warm-up run: its tokens, decode tok/s (after the first token) and the engine's stats."""
    llm.generate([prompt], params, use_tqdm=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    tokens = out.outputs[0].token_ids
    return tokens, (len(tokens) - 1) / (m.finished_time - m.first_token_time), llm.get_stats()


def batch1(shape: str, k: int, max_tokens: int) -> None:
    """Batch-1 decode on the shape (random weights) with and without n-gram drafts, the prompt a 64-token run said
    four times: what the random model then writes decides the acceptance, reported beside the speed."""
    model = str(shape_checkpoint(shape, Path("/tmp/minfer-shapes"), "dummy"))
    run = [(i * 7919) % 20000 + 100 for i in range(64)]
    prompt = {"prompt_token_ids": run * 4}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows, base = [], None
    for name, spec in [("none", None), ("ngram", {"method": "ngram", "num_speculative_tokens": k,
                                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})]:
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, speculative_config=spec)
        _, speed, s = _batch1_speed(llm, prompt, params)
        base = base or speed
        rows.append([name, f"{speed:.1f}", f"{speed / base:.2f}×",
                     f"{s['spec_decode_acceptance_rate']:.3f}" if spec else "—",
                     f"{s['spec_decode_mean_acceptance_length']:.2f}" if spec else "—"])
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    _table(f"batch1_{shape}", ["speculation", "batch-1 decode tok/s", "speed-up", "acceptance", "tokens per step"],
           rows)


def eagle_head(shape_dir: str, full_vocab: bool = False) -> str:
    """A random-weight EAGLE-3 head for the target in ``shape_dir``: its width, heads and MLP, one layer, a draft
    vocabulary of 32,000 ids, as the public Llama-3.1-8B heads have (weights drawn at load: ``load_format`` dummy)."""
    import json

    cfg = json.loads((Path(shape_dir) / "config.json").read_text())
    head = Path(shape_dir + ("-eagle3-full" if full_vocab else "-eagle3"))
    head.mkdir(parents=True, exist_ok=True)
    keys = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size", "torch_dtype"]
    (head / "config.json").write_text(json.dumps({k: cfg[k] for k in keys if k in cfg} | {
        "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
        "draft_vocab_size": cfg["vocab_size"] if full_vocab else min(32000, cfg["vocab_size"])}))
    return str(head)


def eagle(shape: str, k: int, max_tokens: int) -> None:
    import minfer.engine.spec.speculator as speculator

    model = str(shape_checkpoint(shape, Path("/tmp/minfer-shapes"), "dummy"))
    head = eagle_head(model)
    prompt = {"prompt_token_ids": [(i * 7919) % 20000 + 100 for i in range(256)]}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows, base = [], None
    speculator.BACKOFF_AFTER = 10**9  # every step drafts (and nothing is accepted): the cost of a drafting step
    for name, spec in [("none", None), (f"eagle3, k={k}", {"method": "eagle3", "model": head,
                                                           "num_speculative_tokens": k})]:
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, speculative_config=spec)
        _, speed, s = _batch1_speed(llm, prompt, params)
        base = base or speed
        per_step = s["spec_decode_mean_acceptance_length"] if spec else 1.0
        step_ms = 1000 * per_step / speed
        rows.append([name, f"{speed:.1f}", f"{step_ms:.2f}", f"{step_ms * base / 1000:.3f}×",
                     f"{s['spec_decode_acceptance_rate']:.3f}" if spec else "—"])
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    _table(f"eagle_{shape}", ["batch 1, random weights", "decode tok/s", "ms per step", "step / plain step",
                              "acceptance"], rows)


def repeat_last_token(model: torch.nn.Module, embedding: torch.Tensor) -> None:
    """Make a Llama-layout model (or EAGLE-3 head) write its last token again: every layer adds zero to the
    residual stream and the LM head is the token ``embedding`` (in place: the captured graphs read these tensors)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        if hasattr(model, "fc"):  # a head: its feature is the last captured layer's state (the embedding)
            h = model.config.hidden_size
            model.fc.weight.zero_()
            model.fc.weight[:, 2 * h:].copy_(torch.eye(h))
        model.lm_head.weight.copy_(embedding)


def ceiling(shape: str, ks: list[int], max_tokens: int) -> None:
    model = str(shape_checkpoint(shape, Path("/tmp/minfer-shapes"), "dummy"))
    head = eagle_head(model, full_vocab=True)
    prompt = {"prompt_token_ids": [(i * 7919) % 20000 + 100 for i in range(256)]}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = [("none", None)] + [(f"ngram, k={k}", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                                  "prompt_lookup_max": 4}) for k in ks] + \
        [(f"eagle3, k={k}", {"method": "eagle3", "model": head, "num_speculative_tokens": k}) for k in ks]
    rows, base, reference = [], None, None
    for name, spec in runs:
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, speculative_config=spec)
        target = llm.llm_engine.runner.model
        repeat_last_token(target, target.embed_tokens.weight)
        drafter = llm.llm_engine.speculator.drafter if spec else None
        if drafter is not None:
            repeat_last_token(drafter.model, target.embed_tokens.weight)
        tokens, speed, s = _batch1_speed(llm, prompt, params)
        reference = reference or tokens
        base = base or speed
        rows.append([name, f"{speed:.1f}", f"{speed / base:.2f}×", "yes" if tokens == reference else "NO",
                     f"{s['spec_decode_acceptance_rate']:.3f}" if spec else "—",
                     f"{s['spec_decode_mean_acceptance_length']:.2f}" if spec else "—"])
        llm.shutdown()
        del llm, target, drafter
        gc.collect()  # the runner and its drafter refer to each other
        torch.cuda.empty_cache()
    _table(f"ceiling_{shape}", ["batch 1, every draft right", "decode tok/s", "speed-up", "output = none's",
                                "acceptance", "tokens per step"], rows)


def batch(shape: str, size: int, k: int) -> None:
    model = str(shape_checkpoint(shape, Path("/tmp/minfer-shapes"), "dummy"))
    rows, base = [], None
    prompts = [{"prompt_token_ids": [(i * 31 + j * 7) % 5000 + 100 for j in range(256)]} for i in range(size)]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for name, spec in [("none", None), ("ngram, default rule", {"method": "ngram", "num_speculative_tokens": k}),
                       ("ngram, always on", {"method": "ngram", "num_speculative_tokens": k,
                                             "disable_by_batch_size": 0})]:
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=1024, speculative_config=spec)
        llm.generate(prompts[:2], params, use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
        base = base or tok_s
        drafts = llm.get_stats().get("spec_decode_num_draft_tokens", "—")
        rows.append([name, f"{tok_s:.0f}", f"{tok_s / base:.3f}", drafts])
        llm.shutdown()
        del llm
        torch.cuda.empty_cache()
    _table(f"batch{size}_{shape}", [f"{size} requests × 256 in / 256 out", "output tok/s", "× none", "draft tokens"],
           rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["verify", "pair", "batch1", "batch", "eagle", "ceiling"])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--target", help="pair: the target model folder (e.g. one `minfer train` wrote)")
    ap.add_argument("--draft", default=None, help="pair: the draft (default: the built-in model)")
    ap.add_argument("-k", type=int, default=4, help="drafted tokens a step")
    ap.add_argument("--ks", default="3,5,7", help="verify: the drafts a step scores, comma-separated")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if args.part == "verify":
        verify_cost(args.shape, [int(x) for x in args.ks.split(",")], args.iters)
    elif args.part == "pair":
        from minfer.llm import builtin_model_path

        pair(args.target, args.draft or str(builtin_model_path()), args.k, args.max_tokens, args.prompts)
    elif args.part == "batch1":
        batch1(args.shape, args.k, args.max_tokens)
    elif args.part == "eagle":
        eagle(args.shape, args.k, args.max_tokens)
    elif args.part == "ceiling":
        ceiling(args.shape, [int(x) for x in args.ks.split(",")], args.max_tokens)
    else:
        batch(args.shape, args.batch, args.k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
