"""The physical lower bounds every ``minfer bench`` result is reported against (BENCHMARKS.md's method): what one
GPU of a tensor-parallel group reads and computes per step (``DecodeCost``), and the batch-1 and workload bounds
it gives at the H200's measured rates."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from minfer.config import ModelConfig
from minfer.engine.state_cache import slot_bytes

if TYPE_CHECKING:
    from minfer.llm import LLM

HBM_BYTES_PER_S = 4.22e12  # measured H200 copy bandwidth, per GPU (BENCHMARKS.md)
BF16_FLOP_S = 793e12  # measured H200 dense bf16 matmul rate, per GPU (BENCHMARKS.md)
FP8_FLOP_S = 1.2e15  # measured H200 FP8 matmul rate (torch._scaled_mm, M >= 1024), per GPU


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
    # recurrent layers (Qwen3.5): one sequence's state bytes, read and written by every token it decodes
    state_bytes: float = 0.0

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
                       matmul_flop_s=FP8_FLOP_S if model.quant is not None else BF16_FLOP_S,
                       state_bytes=float(slot_bytes(runner.state_layers)))


def batch1_bound(cost: DecodeCost, bandwidth: float = HBM_BYTES_PER_S) -> float:
    """Decode tok/s of one request if every step only read the weights (and a recurrent model's state, read and
    written): N GPUs, each reading its 1/N share at ``bandwidth`` (the context's K and V are left out: small at
    batch 1)."""
    return bandwidth / (cost.weight_bytes + 2 * cost.state_bytes)


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
    kv = decode_ctx * cost.kv_bytes_per_token + 2 * n_out * cost.state_bytes  # (the state: read and written)
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
