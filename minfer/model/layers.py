"""Building blocks of the decoder: fused linear layers that load HF shards, RMSNorm, rotary, SwiGLU.

Each block has a torch path with HF's rounding (the reference, and the CPU path) and, when built
with ``use_triton``, calls the fused Triton kernel of ``minfer.kernels`` instead.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class FusedLinear(nn.Module):
    """y = x Wᵀ (+ b), where W stacks several checkpoint matrices along the output dimension.

    q/k/v become one matmul and gate/up another: fewer, larger GEMMs. ``shard_sizes`` gives the
    rows each checkpoint tensor fills; ``load_shard`` copies one of them into its slice.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype,
                 use_triton: bool = False) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        self.use_triton = use_triton
        self.weight = nn.Parameter(torch.empty(sum(shard_sizes), in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(shard_sizes), dtype=dtype), requires_grad=False) if bias else None

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int) -> None:
        param = self.weight if name == "weight" else self.bias
        start = sum(self.shard_sizes[:shard])
        target = param.data.narrow(0, start, self.shard_sizes[shard])
        if target.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton and x.dim() == 2 and x.shape[0] == 1:  # batch-1 decode: a weight stream
            from minfer.kernels.gemv import gemv

            return gemv(x.contiguous(), self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm with HF Llama's rounding: statistics in float32, the weight multiply in the model dtype.

    ``forward(x, residual)`` first adds the residual (in the model dtype, as HF does) and returns
    the normed output together with the new residual stream.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, use_triton: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.use_triton = use_triton
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self.use_triton:
            from minfer.kernels import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x if x.dim() == 3 else x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
            return fused_add_rms_norm(x, residual, self.weight, self.eps), residual  # residual updated in place
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotary inverse frequencies, with 'linear' or 'llama3' context extension applied.

    llama3 keeps high frequencies, divides low ones by ``factor`` and blends the band between
    (wavelengths measured against the original training context).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
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


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") rotary embedding from a precomputed float32 cache.

    ``cos_sin_cache[p] = [cos(p·f) | sin(p·f)]`` over the head_dim/2 frequencies f: the layout the
    Triton kernels read too.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]; returns them rotated with HF's rounding (products in the model
        dtype). The Triton backend rotates inside its KV-store kernel instead (``kernels/rope_store.py``:
        float32 arithmetic, one rounding)."""
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, use_triton: bool = False) -> None:
        super().__init__()
        self.use_triton = use_triton
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], False, dtype, use_triton)
        self.down_proj = FusedLinear(intermediate, [hidden], False, dtype, use_triton)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from minfer.kernels import silu_and_mul

            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)
