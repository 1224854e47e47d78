"""Building blocks of the decoder: fused linear layers that load HF shards, RMSNorm, rotary, SwiGLU.

Each block computes through the ``Ops`` it was built with (``minfer.ops``): HF's rounding on the torch
ops, the fused Triton kernels on the Triton ops; no block asks which.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.distributed import SINGLE, TensorParallel
from minfer.model.quant import BLOCK, Fp8Format, quantize_rows
from minfer.ops import Fp8Activation, Ops


class FusedLinear(nn.Module):
    """y = x Wᵀ (+ b), where W stacks several checkpoint matrices along the output dimension.

    q/k/v become one matmul and gate/up another: fewer, larger GEMMs. ``shard_sizes`` gives the
    rows each checkpoint tensor fills; ``load_shard`` copies one of them into its slice. The product
    in ``forward`` is the layer's only arithmetic: the seam where a quantized linear method would
    multiply instead (the layer asks it; it does not know the weights' format).

    Under tensor parallelism a layer holds a slice of each checkpoint matrix and reads only that
    slice from the file. Column-parallel (``rows_from``: the first checkpoint row of each stacked
    matrix this rank holds) splits the outputs, and the product needs no communication;
    row-parallel (``cols_from``: the first input column) splits the inputs, and ``reduce`` sums the
    partial products across ranks. Only rank 0 keeps a row-parallel bias, so the sum adds it once.

    With ``quant`` (``model/quant.py``) the weight is e4m3 with float32 ``weight_scale`` (one per row,
    or per row and 128-column block) and optionally a static ``input_scale``; ``ops.fp8_linear``
    multiplies. An online format quantizes each float checkpoint slice as it loads.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype, *,
                 rows_from: list[int] | None = None, cols_from: int | None = None,
                 tp: TensorParallel = SINGLE, quant: Fp8Format | None = None, ops: Ops | None = None) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        self.rows_from = rows_from or [0] * len(shard_sizes)
        self.cols_from = cols_from
        self.tp = tp if cols_from is not None else SINGLE  # only a row-parallel layer communicates
        self.quant, self.ops = quant, ops
        n = sum(shard_sizes)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False) if bias else None
        if quant is None:
            self.weight = nn.Parameter(torch.empty(n, in_features, dtype=dtype), requires_grad=False)
            return
        if quant.block and (cols_from or 0) % BLOCK:
            raise ValueError(f"block FP8 needs each tensor-parallel rank's share of the input features ({in_features}) "
                             f"to start on a {BLOCK}-column block: use a smaller tensor_parallel_size")
        self.weight = nn.Parameter(torch.empty(n, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
        scale_shape = (n, -(-in_features // BLOCK)) if quant.block else (n,)
        self.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False)
        self.input_scale = nn.Parameter(torch.zeros(1), requires_grad=False) if quant.static_input_scale else None

    def checkpoint_keys(self) -> list[tuple[str, int]]:
        """(attribute, stacked matrix) for every tensor the checkpoint must supply."""
        names = ["weight"] + (["bias"] if self.bias is not None else [])
        if self.quant is not None and not self.quant.online:
            names.append("weight_scale")
            if self.quant.static_input_scale:
                names.append("input_scale")
        return [(name, i) for name in names for i in range(len(self.shard_sizes))]

    def load_shard(self, name: str, source: Any, shard: int) -> str | None:
        """Copy this rank's slice of checkpoint tensor ``shard`` from ``source`` (a safetensors slice,
        read lazily, or a tensor) into its rows of the fused parameter; returns the attribute filled."""
        if self.quant is not None and name != "weight" and name != "bias":
            return self._load_quant_tensor(name, source, shard)
        param = self.weight if name == "weight" else self.bias
        start = sum(self.shard_sizes[:shard])
        target = param.data.narrow(0, start, self.shard_sizes[shard])
        rows = slice(self.rows_from[shard], self.rows_from[shard] + self.shard_sizes[shard])
        if name == "weight" and self.cols_from is not None:
            tensor = source[rows, self.cols_from:self.cols_from + param.shape[1]]
        elif name == "bias" and self.cols_from is not None and self.tp.rank > 0:
            target.zero_()
            return name
        else:
            tensor = source[rows]
        if target.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        if name == "weight" and self.quant is not None and self.quant.online:
            tensor, scale = quantize_rows(tensor)
            self.weight_scale.data.narrow(0, start, len(scale)).copy_(scale)
        target.copy_(tensor)
        return name

    def _load_quant_tensor(self, name: str, source: Any, shard: int) -> str | None:
        """A scale of a pre-quantized checkpoint: per tensor, per row ([n] or [n, 1]) or per 128x128 block,
        into this rank's rows (block scales repeated down the rows of their block)."""
        if name == "weight_zero_point":  # symmetric FP8 stores none, or zeros
            return None
        tensor = source[:].float()
        if name == "input_scale":  # q, k and v share their input: the largest scale covers all three
            self.input_scale.data.copy_(torch.maximum(self.input_scale.data, tensor.reshape(-1)[:1].to(self.input_scale.device)))
            return name
        if name not in ("weight_scale", "weight_scale_inv"):
            raise ValueError(f"unexpected quantization tensor {name!r}")
        start, size, first = sum(self.shard_sizes[:shard]), self.shard_sizes[shard], self.rows_from[shard]
        target = self.weight_scale.data.narrow(0, start, size)
        rows = torch.arange(first, first + size)
        if self.quant.block:
            col_block = (self.cols_from or 0) // BLOCK
            target.copy_(tensor[rows // BLOCK][:, col_block:col_block + target.shape[1]])
        elif tensor.numel() == 1:  # per tensor
            target.fill_(float(tensor.reshape(-1)[0]))
        else:
            target.copy_(tensor.reshape(-1)[rows])
        return "weight_scale"

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The full product from this rank's partial one (row-parallel); identity otherwise."""
        return self.tp.all_reduce(y)

    @property
    def fp8_input(self) -> str | None:
        """How the layer before should hand its output over: 'token' / 'block' when this layer takes
        activations the producing kernel already rounded to e4m3 (per token / per 128-column group),
        None for the model dtype (float weights, or a static input scale to apply here)."""
        if self.quant is None or self.quant.static_input_scale:
            return None
        return "block" if self.quant.block else "token"

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if self.quant is None:
            return self.reduce(F.linear(x, self.weight, self.bias))
        y = self.ops.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, self.quant.block)
        return self.reduce(y)


class VocabParallelEmbedding(nn.Module):
    """An embedding table (also the LM head's weight) split by vocabulary rows: rank r holds rows
    ``[r*per, (r+1)*per)`` with ``per = ceil(vocab / size)``, the last rank's tail zero-padded, so any
    size splits any vocabulary. A lookup takes the rows this rank holds (zeros elsewhere) and sums
    across ranks; ``gather_logits`` joins the ranks' logit columns and drops the padding."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        per = -(-vocab // tp.size)
        self.start = tp.rank * per
        self.held = max(0, min(per, vocab - self.start))  # rows of real vocabulary on this rank
        self.weight = nn.Parameter(torch.zeros(per, hidden, dtype=dtype), requires_grad=False)

    def load_shard(self, name: str, source: Any, shard: int | None) -> None:
        tensor = source[self.start:self.start + self.held]
        if tensor.shape[1:] != self.weight.shape[1:] or tensor.shape[0] != self.held:
            raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != expected ({self.held}, "
                             f"{self.weight.shape[1]})")
        self.weight.data[:self.held].copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        held = (local >= 0) & (local < self.held)
        x = F.embedding(torch.where(held, local, 0), self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's ``[rows, per]`` logits → the whole vocabulary's ``[rows, vocab]``."""
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.vocab]


class RMSNorm(nn.Module):
    """RMSNorm; ``forward(x, residual)`` first adds the residual and returns the normed output
    together with the new residual stream (the Triton ops fuse the add into the norm)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: str | None = None) -> Any:
        """``fp8`` ('token' / 'block', from the next layer's ``FusedLinear.fp8_input``): emit the normed
        output already rounded to e4m3 (an ``Fp8Activation``)."""
        if fp8 is not None:
            block = fp8 == "block"
            if residual is None:
                return self.ops.rms_norm_fp8(x, self.weight, self.eps, block)
            return self.ops.add_rms_norm_fp8(x, residual, self.weight, self.eps, block)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


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
    """The table of a non-interleaved ("rotate half") rotary embedding, precomputed in float32.

    ``cos_sin_cache[p] = [cos(p·f) | sin(p·f)]`` over the head_dim/2 frequencies f: any scaling is
    decided here, once, and the ops that rotate (``Ops.rope_store_kv``) read only this table.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul; under tensor
    parallelism each rank holds a share of the intermediate features (gate/up by rows, down by
    columns), and only down's output is summed across ranks."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: Fp8Format | None = None, prefix: str = "mlp") -> None:
        super().__init__()
        self.ops = ops
        start, inter = tp.split(intermediate)
        gate_up = quant if quant and quant.quantizes([f"{prefix}.gate_proj", f"{prefix}.up_proj"]) else None
        down = quant if quant and quant.quantizes([f"{prefix}.down_proj"]) else None
        self.gate_up_proj = FusedLinear(hidden, [inter, inter], False, dtype, rows_from=[start, start],
                                        quant=gate_up, ops=ops)
        self.down_proj = FusedLinear(inter, [hidden], False, dtype, cols_from=start, tp=tp, quant=down, ops=ops)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fp8 = self.down_proj.fp8_input
        act = self.ops.silu_and_mul(gate_up) if fp8 is None else self.ops.silu_and_mul_fp8(gate_up, fp8 == "block")
        return self.down_proj(act)
