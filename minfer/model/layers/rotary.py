"""Rotary position embeddings: the cos/sin table, with 'linear', 'llama3', 'longrope' or 'yarn' context extension
applied."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, context: int = 0) -> torch.Tensor:
    """Rotary inverse frequencies, with 'linear', 'llama3', 'longrope' or 'yarn' context extension applied.

    llama3 keeps high frequencies, divides low ones by ``factor`` and blends the band between
    (wavelengths measured against the original training context). longrope divides each frequency by
    its own factor: ``short_factor`` for sequences within ``original_max_position_embeddings``,
    ``long_factor`` beyond it. ``context`` is the longest sequence the table serves (the engine's
    max_model_len): longrope takes the long factors when it exceeds the original length (``long_rope``).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        # as HF writes it: 1 / (factor * theta^(2i/d)), the factor inside the product
        factors = scaling["long_factor"] if long_rope(scaling, context) else scaling["short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope needs {head_dim // 2} factors (head_dim / 2), got {len(factors)}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(theta ** exponents, head_dim, theta, factor, scaling)
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(wavelengths: torch.Tensor, head_dim: int, theta: float, factor: float,
                   scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as HF computes it: frequencies that turn fewer than ``beta_slow`` times over the
    original context are divided by ``factor`` (interpolated), those that turn more than ``beta_fast`` times are
    kept (extrapolated), and a linear ramp over the dimension index blends the band between. ``truncate``
    (default true; gpt-oss sets false) rounds the band's ends outward to whole dimensions."""
    old_len = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # each term rounded as HF rounds it (``wavelengths``: theta^(2i/d), the frequencies' inverses)
    return 1.0 / (factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


def long_rope(scaling: dict[str, Any], context: int) -> bool:
    """Whether a longrope table serving sequences of up to ``context`` tokens takes the long factors.

    HF chooses per forward, by the sequence's length so far (``> original_max_position_embeddings``:
    long), so a sequence's earlier keys may have been rotated with the other set. A paged cache shares and
    recomputes keys across steps, so here every position of every sequence uses one set, fixed by the
    longest sequence the engine admits (as vLLM does). With ``max_model_len`` within the original length,
    every sequence is short and the table is HF's; beyond it, the table is HF's for every sequence whose
    prompt is longer than the original length (HF then rotates the prompt, and everything after it, with
    the long factors), and shorter sequences are rotated with the long factors where HF uses the short."""
    return context > int(scaling["original_max_position_embeddings"])


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What longrope and yarn multiply cos and sin by (1 otherwise): the config's ``attention_factor``, or HF's
    default for a ``factor`` above 1: sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) for longrope,
    0.1·ln(factor) + 1 for yarn (with ``mscale`` / ``mscale_all_dim``: the ratio of two such terms)."""
    if scaling is None or scaling["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if factor <= 1.0:
        return 1.0
    if scaling["rope_type"] == "yarn":
        mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and all_dim:
            return (0.1 * mscale * math.log(factor) + 1) / (0.1 * all_dim * math.log(factor) + 1)
        return 0.1 * math.log(factor) + 1
    return math.sqrt(1 + math.log(factor) / math.log(int(scaling["original_max_position_embeddings"])))


class RotaryEmbedding(nn.Module):
    """The table of a non-interleaved ("rotate half") rotary embedding, precomputed in float32.

    ``cos_sin_cache[p] = [a·cos(p·f) | a·sin(p·f)]`` over the head_dim/2 frequencies f (``a``: longrope's or
    yarn's attention factor, else 1): any scaling is decided here, once, and the ops that rotate
    (``Ops.rope_store_kv``) read only this table. ``max_position`` is the engine's max_model_len, which also
    picks longrope's factor set (``long_rope``).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        scale = rope_attention_factor(scaling)  # HF multiplies the float32 cos/sin by it, then rounds
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1),
                             persistent=False)
