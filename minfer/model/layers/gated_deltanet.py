"""Gated DeltaNet linear attention (Qwen3.5's, after Qwen3-Next): a layer whose memory of the past is a
fixed-size state per sequence, not a growing KV cache.

Each token's fused q/k/v channels go through a short depthwise causal convolution (SiLU), then the gated delta
rule updates a [Dk, Dv] matrix per value head, ``S ← exp(g)·S + β·k(v - Sᵀk)ᵀ`` (q and k L2-normalised), and
reads it out with q; a gated RMSNorm (``norm(o) · silu(z)``) and the output projection follow. ``g`` (the
log decay) and ``β`` (the write strength) come from two small projections per value head.

The state lives in the engine's state cache (``engine/state_cache.py``): ``conv_state`` ``[slots, C, K - 1]``
(the last K - 1 conv inputs, in the model dtype) and ``rec_state`` ``[slots, Hv, Dk, Dv]`` (float32), one slot
per running sequence (its input-batch row: ``AttentionMetadata.state_slots``). A step's chunk starts from its
slot's state when the sequence has computed tokens before (``has_state``), else from zeros, and leaves the state
after its last token in the slot; so chunked prefill carries the state across chunks, and a preempted sequence
(recomputed from its first token) starts afresh.

Under tensor parallelism the key heads and the value heads split across ranks (value head j reads key head
j // (Hv / Hk), so contiguous shares line up); the conv channels split with them, and ``out_proj`` is
row-parallel.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers.linear import FusedLinear
from minfer.model.quantization.base import UNQUANTIZED, QuantConfig
from minfer.ops import AttentionMetadata, Ops


class LinearAttentionDims:
    """A Gated DeltaNet layer's sizes, whole (``Hk``, ``Hv``) and this rank's (``hk``, ``hv``, first heads)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        x = cfg.extra
        self.Hk, self.Hv = x["linear_num_key_heads"], x["linear_num_value_heads"]
        self.Dk, self.Dv, self.K = x["linear_key_head_dim"], x["linear_value_head_dim"], x["linear_conv_kernel_dim"]
        if self.Hv % self.Hk:
            raise ValueError(f"linear_num_value_heads {self.Hv} must be a multiple of linear_num_key_heads {self.Hk}")
        self.k0, self.hk = tp.split(self.Hk)
        self.v0, self.hv = tp.split(self.Hv)

    @property
    def channels(self) -> list[int]:
        """This rank's conv channels: its q, k and v parts."""
        return [self.hk * self.Dk, self.hk * self.Dk, self.hv * self.Dv]


class CausalConv(nn.Module):
    """The depthwise conv's weight ``[C, K]``, this rank's channels of the checkpoint's ``[Ctotal, 1, K]``."""

    def __init__(self, dims: LinearAttentionDims, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = dims
        self.weight = nn.Parameter(torch.empty(sum(dims.channels), dims.K, dtype=dtype), requires_grad=False)

    def load_shard(self, name: str, source: Any, shard: Any) -> None:
        d = self.dims
        starts = [d.k0 * d.Dk, d.Hk * d.Dk + d.k0 * d.Dk, 2 * d.Hk * d.Dk + d.v0 * d.Dv]
        rows = torch.cat([source[s:s + n] for s, n in zip(starts, d.channels)])
        if rows.shape[0] != self.weight.shape[0] or rows.shape[-1] != d.K:
            raise ValueError(f"conv1d weight {tuple(rows.shape)} does not fit {tuple(self.weight.shape)}")
        self.weight.data.copy_(rows.reshape(self.weight.shape))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops, tp: TensorParallel = SINGLE,
                 quant: QuantConfig | None = None, prefix: str = "linear_attn") -> None:
        super().__init__()
        self.ops, self.dtype, self.eps = ops, dtype, cfg.rms_norm_eps
        d = self.dims = LinearAttentionDims(cfg, tp)

        def method(*names: str):
            return quant.linear_method([f"{prefix}.{n}" for n in names]) if quant else UNQUANTIZED

        self.in_proj_qkv = FusedLinear(cfg.hidden_size, d.channels, False, dtype, method=method("in_proj_qkv"), ops=ops,
                                       rows_from=[d.k0 * d.Dk, d.k0 * d.Dk, d.v0 * d.Dv])
        self.in_proj_zba = FusedLinear(cfg.hidden_size, [d.hv * d.Dv, d.hv, d.hv], False, dtype, ops=ops,
                                       method=method("in_proj_z", "in_proj_b", "in_proj_a"),
                                       rows_from=[d.v0 * d.Dv, d.v0, d.v0])
        self.conv1d = CausalConv(d, dtype)
        self.dt_bias = nn.Parameter(torch.empty(d.hv, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(d.hv, dtype=dtype), requires_grad=False)
        self.norm = nn.Module()  # the gated RMSNorm's weight [Dv], whole on every rank
        self.norm.weight = nn.Parameter(torch.empty(d.Dv, dtype=dtype), requires_grad=False)
        self.out_proj = FusedLinear(d.hv * d.Dv, [cfg.hidden_size], False, dtype, cols_from=d.v0 * d.Dv, tp=tp,
                                    method=method("out_proj"), ops=ops)
        self.conv_state = torch.empty(0)  # the engine's state cache fills these
        self.rec_state = torch.empty(0)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """One slot's state tensors: name -> (shape, dtype)."""
        d = self.dims
        return {"conv_state": ((sum(d.channels), d.K - 1), self.dtype),
                "rec_state": ((d.hv, d.Dk, d.Dv), torch.float32)}

    def load_shard(self, name: str, source: Any, shard: Any) -> None:
        """``dt_bias`` and ``A_log``: this rank's value heads."""
        if name not in ("dt_bias", "A_log"):
            raise ValueError(f"unexpected tensor {name!r} for a Gated DeltaNet layer")
        d = self.dims
        getattr(self, name).data.copy_(source[d.v0:d.v0 + d.hv])

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d, t = self.dims, x.shape[0]
        zba = self.in_proj_zba(x)
        o = self.delta_rule(self.in_proj_qkv(x), zba, meta)
        o = self.ops.gated_rms_norm(o, self.z(zba), self.norm.weight, self.eps)
        return self.out_proj(o.reshape(t, d.hv * d.Dv))

    def z(self, zba: torch.Tensor) -> torch.Tensor:
        """The output norm's gate, a ``[T, Hv, Dv]`` view of the fused z|b|a projection."""
        d = self.dims
        return zba[:, :d.hv * d.Dv].view(zba.shape[0], d.hv, d.Dv)

    def delta_rule(self, qkv: torch.Tensor, zba: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything between the input projections and the output norm: the causal conv, then the gated delta rule
        over the layer's state slots, its gates computed by the op from b, a and the layer's ``A_log``, ``dt_bias``
        -> o ``[T, Hv, Dv]`` (the batch-1 forward, ``ops/one_token.py``, norms it in out_proj's prologue)."""
        d, t = self.dims, qkv.shape[0]
        _, b, a = zba.split([d.hv * d.Dv, d.hv, d.hv], dim=-1)
        qkv = self.ops.causal_conv1d(qkv, self.conv1d.weight, self.conv_state, meta.query_start_loc,
                                     meta.state_slots, meta.has_state)
        q, k, v = qkv.split(d.channels, dim=-1)
        return self.ops.gated_delta_rule(q.reshape(t, d.hk, d.Dk), k.reshape(t, d.hk, d.Dk), v.reshape(t, d.hv, d.Dv),
                                         a, b, self.A_log, self.dt_bias, self.rec_state, meta.query_start_loc,
                                         meta.state_slots, meta.has_state)

