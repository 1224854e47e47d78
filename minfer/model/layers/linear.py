"""``FusedLinear``: y = x Wᵀ (+ b), where W stacks several checkpoint matrices along the output dimension.

q/k/v become one matmul and gate/up another: fewer, larger GEMMs. ``shard_sizes`` gives the rows each
checkpoint tensor fills; ``load_shard`` copies one of them into its slice.

Under tensor parallelism a layer holds a slice of each checkpoint matrix and reads only that slice from
the file. Column-parallel (``rows_from``: the first checkpoint row of each stacked matrix this rank holds)
splits the outputs, and the product needs no communication; row-parallel (``cols_from``: the first input
column) splits the inputs, and ``reduce`` sums the partial products across ranks. Only rank 0 keeps a
row-parallel bias, so the sum adds it once. A checkpoint that stores the stacked matrices as one tensor
(Phi-3's ``qkv_proj``) fills every shard from it: ``stack_checkpoint_rows`` moves each shard's
``rows_from`` past the whole matrices before it, so each rank still reads only its rows, and a weight
format's scales (per row or per block of rows) are read at the same checkpoint rows.

What a weight row is made of, how it loads and how the product runs belong to the layer's
``LinearMethod`` (``minfer.model.quantization``): float by default.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.distributed import SINGLE, TensorParallel
from minfer.model.quantization.base import UNQUANTIZED, Activation, ActivationQuant, LinearMethod
from minfer.ops import Ops


class FusedLinear(nn.Module):
    lora: Any = None  # LoRA adapters added after the base product (``layers/lora.py``), None without

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, dtype: torch.dtype, *,
                 rows_from: list[int] | None = None, cols_from: int | None = None,
                 tp: TensorParallel = SINGLE, method: LinearMethod = UNQUANTIZED, ops: Ops | None = None) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        self.rows_from = rows_from or [0] * len(shard_sizes)
        self.cols_from = cols_from
        self.tp = tp if cols_from is not None else SINGLE  # only a row-parallel layer communicates
        self.method, self.ops = method, ops
        n = sum(shard_sizes)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False) if bias else None
        method.create_weights(self, n, in_features, dtype)

    def stack_checkpoint_rows(self, full_sizes: list[int]) -> None:
        """Read the shards from one checkpoint tensor that stacks their whole matrices (``full_sizes`` rows
        each, in shard order): shard i's rows start after the matrices of shards 0..i-1."""
        if len(full_sizes) != len(self.shard_sizes):
            raise ValueError(f"{len(full_sizes)} stacked matrices for a layer of {len(self.shard_sizes)} shards")
        offsets = [sum(full_sizes[:i]) for i in range(len(full_sizes))]
        self.rows_from = [first + offset for first, offset in zip(self.rows_from, offsets)]

    @property
    def input_quant(self) -> ActivationQuant | None:
        """The format the layer before should emit this layer's input in (None: the model dtype, which LoRA
        adapters read too)."""
        return self.method.input_quant if self.lora is None else None

    def checkpoint_keys(self) -> list[tuple[str, int]]:
        """(attribute, stacked matrix) for every tensor the checkpoint must supply."""
        names = ["weight"] + (["bias"] if self.bias is not None else []) + self.method.checkpoint_tensors()
        return [(name, i) for name in names for i in range(len(self.shard_sizes))]

    def load_shard(self, name: str, source: Any, shard: int) -> str | None:
        """Copy this rank's slice of checkpoint tensor ``shard`` from ``source`` (a safetensors slice,
        read lazily, or a tensor) into its rows of the fused parameter; returns the attribute filled."""
        if name != "weight" and name != "bias":
            return self.method.load_tensor(self, name, source, shard)
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
        if name == "weight":
            tensor = self.method.convert_weight(self, tensor, start)
        target.copy_(tensor)
        return name

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The full product from this rank's partial one (row-parallel); identity otherwise."""
        return self.tp.all_reduce(y)

    def forward(self, x: Activation) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add(y, x)
        return self.reduce(y)
