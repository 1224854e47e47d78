"""`minfer bench`: offline throughput (workload A or fixed lengths), batch-1 decode latency, and a
same-process comparison with HF transformers' continuous batching (``generate_batch``)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from minfer.benchmark.workload import (
    WORKLOAD_A_BOUND, WORKLOAD_A_MAX_TOKEN_ID, WORKLOAD_A_SUM_BOUND, fixed_workload, workload_a,
)
from minfer.llm import LLM
from minfer.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.22e12  # measured H200 copy bandwidth (BENCHMARKS.md)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def weight_bytes(llm: LLM) -> int:
    """Bytes of the model's weights (a tied embedding counted once): what each decode step reads."""
    model = llm.llm_engine.runner.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_throughput(llm: LLM, prompts: list[dict], params: list[SamplingParams], progress: bool) -> dict[str, Any]:
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    preempted_before = llm.get_stats()["num_preemptions"]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"requests": len(outs), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
            "seconds": round(elapsed, 3), "output_tok_s": round(out_tokens / elapsed, 1),
            "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1),
            "num_preemptions": llm.get_stats()["num_preemptions"] - preempted_before,
            "num_kv_blocks": llm.get_stats()["num_kv_blocks"],
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if torch.cuda.is_available() else None}


def run_batch1(llm: LLM, input_len: int, output_len: int) -> dict[str, Any]:
    """Decode speed of one request (first token excluded) against the weights/bandwidth bound
    (the H200's 4.22 TB/s: the share is only meaningful there)."""
    prompts, _ = fixed_workload(1, input_len, output_len, vocab_size=llm.llm_engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)]  # greedy, unlike the workload
    llm.generate(prompts, [SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)], use_tqdm=False)
    _sync()
    out = llm.generate(prompts, params, use_tqdm=False)[0]
    m = out.metrics
    decode_s = m.finished_time - m.first_token_time
    tok_s = (len(out.outputs[0].token_ids) - 1) / decode_s
    weights = weight_bytes(llm)
    bound = HBM_BYTES_PER_S / weights
    return {"input_len": input_len, "output_len": output_len, "decode_tok_s": round(tok_s, 1),
            "ttft_s": round(m.first_token_time - m.arrival_time, 4), "weights_gib": round(weights / 2**30, 3),
            "bound_tok_s": round(bound, 1), "share_of_bound": round(tok_s / bound, 6)}


def run_hf(model: str, prompts: list[dict], output_len: int) -> dict[str, Any]:
    """HF transformers' continuous batching on the same prompts (every request output_len tokens)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    config = GenerationConfig(max_new_tokens=output_len, do_sample=True, temperature=0.6, eos_token_id=None,
                              pad_token_id=0)
    inputs = [p["prompt_token_ids"] for p in prompts]
    kw: dict[str, Any] = {}
    if device == "cpu":  # HF sizes its cache from free memory otherwise: seconds of zero-filling on a CPU
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kw["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)
    hf.generate_batch(inputs[:2], generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                                                                     eos_token_id=None, pad_token_id=0), **kw)
    _sync()
    start = time.perf_counter()
    outs = hf.generate_batch(inputs, generation_config=config, **kw)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"requests": len(inputs), "output_tokens": tokens, "seconds": round(elapsed, 3),
            "output_tok_s": round(tokens / elapsed, 1)}


def bench(model: str, shape: str | None, engine_kwargs: dict[str, Any], *, num_prompts: int = 256,
          input_len: int | None = None, output_len: int = 128, batch1: bool = False, compare_hf: bool = False,
          hf_num_prompts: int = 64, hf_output_len: int = 256, progress: bool = True) -> dict[str, Any]:
    for name, value in (("num_prompts", num_prompts), ("output_len", output_len),
                        ("input_len", 1 if input_len is None else input_len),
                        ("hf_num_prompts", hf_num_prompts), ("hf_output_len", hf_output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    llm = LLM(model, **(engine_kwargs | {"skip_tokenizer_init": True}))  # the prompts are token ids
    vocab = llm.llm_engine.model_config.vocab_size
    if not batch1 and input_len is None and vocab <= WORKLOAD_A_MAX_TOKEN_ID:
        raise ValueError(f"workload A draws token ids up to {WORKLOAD_A_MAX_TOKEN_ID:,}, but this model's vocabulary "
                         f"has {vocab:,}; give --input-len/--output-len for a fixed-length workload")
    result: dict[str, Any] = {"model": shape or model, "device": _device(),
                              "engine": {k: v for k, v in engine_kwargs.items() if v is not None}}
    if batch1:
        result["batch1"] = run_batch1(llm, input_len or 128, output_len)
        return result
    if input_len:
        prompts, params = fixed_workload(num_prompts, input_len, output_len, vocab_size=vocab)
        result["workload"] = f"fixed: {num_prompts} x {input_len} in / {output_len} out"
    else:
        prompts, params = workload_a(num_prompts)
        result["workload"] = "A" if num_prompts == 256 else f"A (first {num_prompts})"
    result |= run_throughput(llm, prompts, params, progress)
    if result["workload"] == "A" and shape in WORKLOAD_A_BOUND:
        result["share_of_bound"] = round(result["output_tok_s"] / WORKLOAD_A_BOUND[shape], 4)
        result["share_of_sum_bound"] = round(result["output_tok_s"] / WORKLOAD_A_SUM_BOUND[shape], 4)
    if compare_hf:
        sub = prompts[:hf_num_prompts]
        same = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=hf_output_len) for _ in sub]
        ours = run_throughput(llm, sub, same, progress=False)
        del llm
        theirs = run_hf(model, sub, hf_output_len)
        result["compare_hf"] = {"requests": len(sub), "output_len": hf_output_len, "minfer_output_tok_s":
                                ours["output_tok_s"], "hf_output_tok_s": theirs["output_tok_s"],
                                "speedup": round(ours["output_tok_s"] / theirs["output_tok_s"], 2)}
    return result


def write_outputs(result: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text)
    if plot_path:
        plot(result, Path(plot_path))


def plot(result: dict[str, Any], path: Path) -> None:
    """Bar chart of output tok/s: minfer, HF (if compared), and the physical bounds (if known)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    if "output_tok_s" in result:
        labels.append("minfer")
        values.append(result["output_tok_s"])
    if "compare_hf" in result:
        c = result["compare_hf"]
        labels += [f"minfer ({c['requests']} req)", f"HF generate_batch ({c['requests']} req)"]
        values += [c["minfer_output_tok_s"], c["hf_output_tok_s"]]
    shape = result.get("model")
    if result.get("workload") == "A" and shape in WORKLOAD_A_BOUND:
        labels += ["sum bound", "bound"]
        values += [WORKLOAD_A_SUM_BOUND[shape], WORKLOAD_A_BOUND[shape]]
    if "batch1" in result:
        labels += ["batch-1 decode", "weights/bandwidth bound"]
        values += [result["batch1"]["decode_tok_s"], result["batch1"]["bound_tok_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.barh(labels, values, color=["#3b7dd8" if "bound" not in lb else "#bbbbbb" for lb in labels])
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"{shape} · {result.get('workload', 'batch 1')} · {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
