"""`minfer bench`: offline throughput (workload A or fixed lengths), batch-1 decode latency, and a
same-process comparison with HF transformers' continuous batching (``generate_batch``).

Every result is reported against physical lower bounds (BENCHMARKS.md's method), computed here from
the model's shape and the run's lengths for the ``tensor_parallel_size`` N GPUs it ran on: each GPU
holds 1/N of every sharded matrix (its query and KV heads, MLP features and vocabulary rows) and
reads only that, so N GPUs give N x the bandwidth and N x the FLOP/s over the same total work.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from minfer.benchmark.bounds import HBM_BYTES_PER_S, DecodeCost, batch1_bound, throughput_bounds
from minfer.benchmark.workload import fit_note, fixed_workload, workload_a
from minfer.config import ModelConfig
from minfer.llm import LLM
from minfer.outputs import RequestOutput
from minfer.sampling_params import SamplingParams

def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def cpu_rates(seconds: float = 0.1) -> tuple[float, float]:
    """This machine's float32 matmul FLOP/s and copy bytes/s (read + write), each measured for about
    ``seconds``: the rates a CPU run's time is estimated at (the engine runs float32 there)."""
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    src = torch.randn(16 << 20)  # 64 MB, past the caches
    dst = torch.empty_like(src)
    rates = []
    for work, amount in ((lambda: a @ b, 2 * 256 * 1024 * 1024), (lambda: dst.copy_(src), 2 * src.nbytes)):
        work()
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or reps < 2:
            work()
            reps += 1
        rates.append(amount * reps / elapsed)
    return rates[0], rates[1]


def estimate_seconds(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int], flop_s: float,
                     bandwidth: float) -> float:
    """A lower bound on a run's time at these rates: ``throughput_bounds``' "sum" bound (bytes and FLOPs one
    after the other) for float32 weights and KV cache, every request resident."""
    cost = DecodeCost.for_model(cfg, 1, weight_element_bytes=4.0, kv_element_bytes=4.0)
    bounds = throughput_bounds(cost, prompt_lens, output_lens, bandwidth=bandwidth, flop_s=flop_s)
    return bounds["byte_s"] + bounds["flop_s"]


def generate_with_progress(llm: LLM, prompts: list[dict], params: list[SamplingParams],
                           progress: bool) -> list[RequestOutput]:
    """``llm.generate``, with a bar that moves before the first request ends (workload A's all end near the
    close): requests finished / total, the output tok/s of every token so far (running requests' too) and
    the time left at that rate (the requests ignore EOS: their output tokens are known)."""
    if not progress:
        return llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    ids = [f"bench-{i}" for i in range(len(prompts))]
    results: dict[str, RequestOutput] = {}
    bar = tqdm(total=len(ids), desc="bench", unit="req", dynamic_ncols=True)
    start = shown = time.perf_counter()
    finished_tokens, total_tokens = 0, sum(p.max_tokens or 0 for p in params)
    try:
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, prompt, p)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    finished_tokens += len(out.outputs[0].token_ids)
                    bar.update(1)
            if (now := time.perf_counter()) - shown >= 1.0:  # a pass over the running requests, once a second
                shown = now
                done = finished_tokens + sum(s.num_output_tokens for s in engine.scheduler.running)
                rate = done / (now - start)
                left = f", ~{(total_tokens - done) / rate / 60:,.1f} min left" if done and total_tokens > done else ""
                bar.set_postfix_str(f"{done:,}/{total_tokens:,} out tokens, {rate:,.1f} tok/s{left}")
    except BaseException:
        for rid in ids:
            engine.abort_request(rid)
        raise
    finally:
        bar.close()
    return [results[rid] for rid in ids]


def run_throughput(llm: LLM, prompts: list[dict], params: list[SamplingParams], progress: bool) -> dict[str, Any]:
    """One timed ``generate`` (after a warm-up request). Under tensor parallelism the KV blocks are per GPU
    (each holds its KV heads of every block, so blocks = cached tokens / block size) and the peak memory
    is rank 0's."""
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = llm.get_stats()
    start = time.perf_counter()
    outs = generate_with_progress(llm, prompts, params, progress)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    stats = llm.get_stats()
    gpus = int(stats.get("tensor_parallel_size", 1)) * int(stats.get("data_parallel_size", 1))
    preempted_before = before["num_preemptions"]
    return {**spec_report(before, stats), "requests": len(outs), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
            "seconds": round(elapsed, 3), "output_tok_s": round(out_tokens / elapsed, 1),
            "output_tok_s_per_gpu": round(out_tokens / elapsed / gpus, 1),
            "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1),
            "num_preemptions": stats["num_preemptions"] - preempted_before,
            "num_kv_blocks": stats["num_kv_blocks"],
            "kv_cache_tokens": stats["num_kv_blocks"] * llm.llm_engine.config.block_size,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if torch.cuda.is_available() else None}


def run_batch1(llm: LLM, input_len: int, output_len: int) -> dict[str, Any]:
    """Decode speed of one request (first token excluded) against the weights/bandwidth bound of the
    engine's N GPUs (``batch1_bound``; the H200's 4.22 TB/s each: the share is only meaningful there)."""
    prompts, _ = fixed_workload(1, input_len, output_len, vocab_size=llm.llm_engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)]  # greedy, unlike the workload
    llm.generate(prompts, [SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)], use_tqdm=False)
    _sync()
    before = llm.get_stats()
    out = llm.generate(prompts, params, use_tqdm=False)[0]
    m = out.metrics
    decode_s = m.finished_time - m.first_token_time
    tok_s = (len(out.outputs[0].token_ids) - 1) / decode_s
    cost = DecodeCost.of_engine(llm)
    bound = batch1_bound(cost)
    return {"input_len": input_len, "output_len": output_len, "tensor_parallel_size": cost.tp,
            "decode_tok_s": round(tok_s, 1), "decode_tok_s_per_gpu": round(tok_s / cost.tp, 1),
            "ttft_s": round(m.first_token_time - m.arrival_time, 4),
            "weights_gib": round(cost.tp * cost.weight_bytes / 2**30, 3),  # read per token, all GPUs together
            "weights_per_gpu_gib": round(cost.weight_bytes / 2**30, 3),
            "bandwidth_tb_s": round(cost.tp * HBM_BYTES_PER_S / 1e12, 2),
            "bound_tok_s": round(bound, 1), "share_of_bound": round(tok_s / bound, 6),
            **spec_report(before, llm.get_stats())}


def spec_report(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding's counters over a run (vLLM's names), when the engine speculates: drafts, drafted and
    accepted tokens, the acceptance rate and the tokens a verified step gained on average."""
    if "spec_decode_num_drafts" not in after:
        return {}
    delta = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                               "spec_decode_num_accepted_tokens")}
    drafts, drafted, accepted = delta.values()
    return {"speculative": {"method": after["spec_decode_method"], **delta,
                            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0}}


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
    if compare_hf and engine_kwargs.get("load_format") == "dummy":
        raise ValueError("compare_hf needs the weights on disk (HF loads them), not load_format='dummy'")
    replicas = engine_kwargs.get("data_parallel_size", 1)
    if replicas > 1 and (batch1 or compare_hf):
        raise ValueError("data_parallel_size > 1 measures the replicas' throughput together: not with batch1 or "
                         "compare_hf (one request, one engine)")
    llm = LLM(model, **(engine_kwargs | {"skip_tokenizer_init": True}))  # the prompts are token ids
    try:
        vocab, max_len = llm.llm_engine.model_config.vocab_size, llm.llm_engine.max_model_len
        result: dict[str, Any] = {"model": shape or model, "device": _device(),
                                  "tensor_parallel_size": llm.get_stats()["tensor_parallel_size"],
                                  "engine": {k: v for k, v in engine_kwargs.items() if v is not None}}
        if batch1:
            result["batch1"] = run_batch1(llm, input_len or 128, output_len)
            return result
        if input_len:
            prompts, params = fixed_workload(num_prompts, input_len, output_len, vocab_size=vocab)
            result["workload"] = f"fixed: {num_prompts} x {input_len} in / {output_len} out"
        else:
            prompts, params = workload_a(num_prompts, max_len, vocab)
            note = "; ".join(filter(None, [f"first {num_prompts}" if num_prompts != 256 else "",
                                           fit_note(max_len, vocab)]))
            result["workload"] = f"A ({note})" if note else "A"
        result |= run_throughput(llm, prompts, params, progress)
        if replicas > 1:  # this process holds no model to price; N replicas' bound is N times one engine's
            result["data_parallel_size"] = replicas
            result["bound_note"] = f"{replicas} x one engine's bounds (run it with data_parallel_size 1)"
            return result
        bounds = throughput_bounds(DecodeCost.of_engine(llm), [len(p["prompt_token_ids"]) for p in prompts],
                                   [p.max_tokens for p in params])
        result["bounds"] = bounds
        result["share_of_bound"] = round(result["output_tok_s"] / bounds["bound_tok_s"], 4)
        result["share_of_sum_bound"] = round(result["output_tok_s"] / bounds["sum_bound_tok_s"], 4)
        if compare_hf:
            sub = prompts[:hf_num_prompts]
            same = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=hf_output_len) for _ in sub]
            ours = run_throughput(llm, sub, same, progress=False)
    finally:
        llm.shutdown()  # tensor-parallel workers and grammar processes
    if compare_hf:
        del llm  # HF needs the memory of the engine's weights and KV cache
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
    shape, tp = result.get("model"), result.get("tensor_parallel_size", 1)
    gpus = f" ({tp} GPUs)" if tp > 1 else ""
    if "bounds" in result:
        labels += [f"sum bound{gpus}", f"bound{gpus}"]
        values += [result["bounds"]["sum_bound_tok_s"], result["bounds"]["bound_tok_s"]]
    if "batch1" in result:
        labels += ["batch-1 decode", f"weights/bandwidth bound{gpus}"]
        values += [result["batch1"]["decode_tok_s"], result["batch1"]["bound_tok_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.barh(labels, values, color=["#3b7dd8" if "bound" not in lb else "#bbbbbb" for lb in labels])
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("output tokens / s")
    device = result["device"] + (f" x {tp}" if tp > 1 else "")
    ax.set_title(f"{shape} · {result.get('workload', 'batch 1')} · {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
