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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from minfer.benchmark.workload import fit_note, fixed_workload, workload_a
from minfer.config import ModelConfig
from minfer.llm import LLM
from minfer.outputs import RequestOutput
from minfer.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.22e12  # measured H200 copy bandwidth, per GPU (BENCHMARKS.md)
BF16_FLOP_S = 793e12  # measured H200 dense bf16 matmul rate, per GPU (BENCHMARKS.md)
FP8_FLOP_S = 1.2e15  # measured H200 FP8 matmul rate (torch._scaled_mm, M >= 1024), per GPU


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """What ONE GPU of a ``tp``-way tensor-parallel group reads and computes; the ranks hold equal
    shares and run at once, so a bound is one GPU's work over one GPU's bandwidth or FLOP/s (the
    same as the N GPUs' total work over N x the bandwidth or FLOP/s).

    ``weight_bytes``: read once per forward step (of a mixture of experts: one token's top-k experts;
    ``step_weight_bytes`` counts what a batch touches): its 1/N of every layer matrix and of the LM head's
    vocabulary rows, the norms whole (replicated; negligible). An untied input embedding is not
    counted: a step reads one row of it per token. ``layer_params`` / ``head_params``: multiply-adds
    per token in the decoder layers / per sampled token in the LM head. ``kv_bytes_per_token``: its KV
    heads' K and V over all layers (a KV head is replicated when N exceeds their number).
    ``attn_flops_per_pair``: one query token against one context token (QK and PV) over its query heads.
    ``window_shares``: (window, share of the KV bytes and attention FLOPs) per window class of layers (0:
    full attention): a sliding-window layer reads at most its window's K and V.
    ``matmul_flop_s``: the decoder layers' products' rate; the LM head and attention stay at bf16's.
    """

    tp: int
    weight_bytes: float
    layer_params: float
    head_params: float
    kv_bytes_per_token: float
    attn_flops_per_pair: float
    matmul_flop_s: float = BF16_FLOP_S  # one GPU's rate for the weight products (FP8 tensor cores for FP8 weights)
    # mixtures of experts: one expert's bytes over all MoE layers (its 1/N share), experts per layer, per token
    expert_bytes: float = 0.0
    num_experts: int = 0
    top_k: int = 0
    window_shares: tuple[tuple[int, float], ...] = ((0, 1.0),)

    def step_weight_bytes(self, batch: int) -> float:
        """Weight bytes one decode step of ``batch`` sequences reads: ``weight_bytes`` counts a token's own
        top-k experts; a batch touches E * (1 - (1 - k/E)^batch) of them on average (uniform routing)."""
        if not self.num_experts:
            return self.weight_bytes
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        return self.weight_bytes + (touched - self.top_k) * self.expert_bytes

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp: int = 1, weight_element_bytes: float = 2.0,
                  kv_element_bytes: float = 2.0, expert_element_bytes: float | None = None) -> "DecodeCost":
        """From the shape alone (bf16 weights and KV cache by default), sharded as ``minfer.model`` does;
        ``expert_element_bytes``: the experts' bytes per weight where their format differs (MXFP4: 0.53)."""
        h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
        heads = cfg.num_attention_heads / tp
        kv_heads = cfg.num_key_value_heads / tp if cfg.num_key_value_heads >= tp else 1
        vocab = -(-cfg.vocab_size // tp)  # the last rank's rows are padded to the same count
        attn = h * heads * d * 2 + 2 * h * kv_heads * d
        moe, dense = len(cfg.moe_layers), layers - len(cfg.moe_layers)
        expert = 3 * h * cfg.moe_intermediate_size / tp  # one expert's matrices in one layer
        active = layers * attn + dense * 3 * h * cfg.intermediate_size / tp + moe * cfg.num_experts_per_tok * expert
        router = moe * cfg.num_experts * h
        bias = (heads + 2 * kv_heads) * d if cfg.attention_bias else 0
        norms = 2 * h + (2 * d if cfg.qk_norm else 0)
        weights = active + router + layers * (bias + norms) + vocab * h + h  # a token's own experts only
        if expert_element_bytes is not None:  # the experts' elements counted in their own format
            weights -= moe * cfg.num_experts_per_tok * expert * (1 - expert_element_bytes / weight_element_bytes)
        expert_element_bytes = expert_element_bytes or weight_element_bytes
        windows = [cfg.layer_window(i) for i in range(layers)]
        shares = tuple((w, windows.count(w) / layers) for w in sorted(set(windows)))
        return cls(tp, weights * weight_element_bytes, active, vocab * h,
                   2 * layers * kv_heads * d * kv_element_bytes, 4 * heads * d * layers,
                   expert_bytes=moe * expert * expert_element_bytes, num_experts=cfg.num_experts,
                   top_k=cfg.num_experts_per_tok, window_shares=shares)

    @classmethod
    def of_engine(cls, llm: LLM) -> "DecodeCost":
        """The running engine's: its tensor-parallel size, the bytes of the weights rank 0 holds (its
        format, whatever it is) and its KV cache's bytes per token (8-bit scales included)."""
        engine = llm.llm_engine
        runner, cfg = engine.runner, engine.model_config
        tp = engine.config.tensor_parallel_size
        model = runner.model
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        if not cfg.tie_word_embeddings:
            held -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
        experts = model.quant.expert_method() if model.quant is not None else None
        cost = cls.for_model(cfg, tp, runner.dtype.itemsize,
                             expert_element_bytes=experts.bytes_per_weight if experts is not None else None)
        held -= (cost.num_experts - cost.top_k) * cost.expert_bytes  # a token reads its top-k experts only
        return replace(cost, weight_bytes=float(held), kv_bytes_per_token=float(runner.kv_spec.token_bytes),
                       matmul_flop_s=FP8_FLOP_S if model.quant is not None else BF16_FLOP_S)


def batch1_bound(cost: DecodeCost, bandwidth: float = HBM_BYTES_PER_S) -> float:
    """Decode tok/s of one request if every step only read the weights: N GPUs, each reading its
    1/N share at ``bandwidth`` (the context's K and V are left out: small at batch 1)."""
    return bandwidth / cost.weight_bytes


def throughput_bounds(cost: DecodeCost, prompt_lens: list[int], output_lens: list[int],
                      bandwidth: float = HBM_BYTES_PER_S, flop_s: float = BF16_FLOP_S) -> dict[str, float]:
    """BENCHMARKS.md's lower bounds on an offline run with every request resident: each of the
    max(output) steps reads the weights once, each output token reads its whole context's K and V;
    FLOPs are 2 x layer parameters x all tokens, the LM head on output tokens only, plus attention
    (decode contexts and causal prefill). Bound = max(byte time, FLOP time) -> output tok/s; the
    "sum" bound adds the two times. All per GPU (``DecodeCost``), so N GPUs bound N x higher."""
    n_in, n_out = sum(prompt_lens), sum(output_lens)
    decode_ctx = sum(share * sum(_decode_context(p, o, w) for p, o in zip(prompt_lens, output_lens))
                     for w, share in cost.window_shares)  # keys read per layer, averaged over the layers
    prefill_ctx = sum(share * sum(_prefill_context(p, w) for p in prompt_lens) for w, share in cost.window_shares)
    kv = decode_ctx * cost.kv_bytes_per_token
    byte_s = (max(output_lens) * cost.step_weight_bytes(len(prompt_lens)) + kv) / bandwidth
    layer_flops = 2 * cost.layer_params * (n_in + n_out)  # at the layers' rate (FP8 tensor cores for FP8)
    other_flops = 2 * cost.head_params * n_out + cost.attn_flops_per_pair * (decode_ctx + prefill_ctx)
    compute_s = layer_flops / (cost.matmul_flop_s * flop_s / BF16_FLOP_S) + other_flops / flop_s
    kv_share = kv / (kv + max(output_lens) * cost.step_weight_bytes(len(prompt_lens)))
    return {"gpus": cost.tp, "byte_s": _sig(byte_s), "kv_share_of_bytes": round(kv_share, 3),
            "flop_s": _sig(compute_s), "bound_tok_s": round(n_out / max(byte_s, compute_s), 1),
            "sum_bound_tok_s": round(n_out / (byte_s + compute_s), 1)}


def _decode_context(prompt: int, output: int, window: int) -> float:
    """Keys the ``output`` decoded tokens of one request read in a layer of ``window`` (0: all): token t
    reads min(prompt + t, window)."""
    below = output if not window else min(output, max(0, window - prompt))  # tokens whose context fits
    return below * prompt + below * (below - 1) / 2 + (output - below) * window


def _prefill_context(prompt: int, window: int) -> float:
    """Keys a prompt's tokens read in a layer of ``window`` (0: all): token i reads min(i + 1, window)."""
    if not window or window >= prompt:
        return prompt * (prompt + 1) / 2
    return window * (window + 1) / 2 + (prompt - window) * window


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


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
    preempted_before = llm.get_stats()["num_preemptions"]
    start = time.perf_counter()
    outs = generate_with_progress(llm, prompts, params, progress)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    stats = llm.get_stats()
    tp = int(stats.get("tensor_parallel_size", 1))
    return {"requests": len(outs), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
            "seconds": round(elapsed, 3), "output_tok_s": round(out_tokens / elapsed, 1),
            "output_tok_s_per_gpu": round(out_tokens / elapsed / tp, 1),
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
    if compare_hf and engine_kwargs.get("load_format") == "dummy":
        raise ValueError("compare_hf needs the weights on disk (HF loads them), not load_format='dummy'")
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
