"""Loading a PEFT LoRA adapter folder and checking it against the base model, and one rank's share of it.

A module's update is ``y += scaling * (x @ A.T) @ B.T`` with ``A [rank, in]`` and ``B [out, rank]`` as
PEFT stores them. Everything is checked before anything is returned, so a refused adapter leaves nothing
behind: no tensor escapes a failed ``load_adapter``, and the caller's caches are only filled on success.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from minfer.distributed import TensorParallel
from minfer.lora.layout import PROJECTIONS, ROW_PARALLEL, BaseLinears, module_group
from minfer.lora.peft_config import LoRAAdapterError, PeftLoRAConfig, parse_peft_config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"

# PEFT's saved names: the PeftModel's prefix, then the causal LM's own module path
_TENSOR_NAME = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
# what a tensor the pattern refuses most likely is, for the message
_TENSOR_HINTS = (("lora_magnitude_vector", "a DoRA magnitude vector (DoRA is not supported)"),
                 ("lora_embedding_", "an embedding LoRA (embedding targets are not supported)"),
                 ("embed_tokens", "an embedding target (not supported)"),
                 ("lm_head", "an lm_head target (not supported)"),
                 ("modules_to_save", "a modules_to_save copy (not supported)"),
                 ("bias", "a bias (LoRA biases are not supported)"))


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One projection's adapter: ``lora_a [rank, in]``, ``lora_b [out, rank]`` in the file's dtype, and the
    scale its product takes (kept apart here; the slots fold it into B)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The update this module adds to the base projection of ``x [tokens, in]``, in float32: the
        reference the kernels and the slots are compared with."""
        return (x.float() @ self.lora_a.float().T) @ self.lora_b.float().T * self.scaling


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A loaded adapter on the host: (layer, projection) -> its weights; ``rank`` is the largest module's."""

    path: str
    rank: int
    modules: dict[tuple[int, str], LoRAWeights]
    config: PeftLoRAConfig


def load_adapter(path: str | Path, base: BaseLinears, max_lora_rank: int) -> LoRAAdapter:
    """The adapter in folder ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``, or
    ``adapter_model.bin``), on the CPU, checked against ``base`` and ``max_lora_rank``; every refusal is a
    ``LoRAAdapterError`` naming the folder and what is wrong."""
    folder = Path(path)
    where = f"LoRA adapter {str(folder)!r}"
    if not folder.is_dir():
        raise LoRAAdapterError(f"{where}: no such folder")
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise LoRAAdapterError(f"{where}: missing {ADAPTER_CONFIG}")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{where}: {ADAPTER_CONFIG} is not valid JSON ({e})") from None
    config = parse_peft_config(raw, where)
    modules = _modules(_read_tensors(folder, where), config, base, max_lora_rank, where)
    return LoRAAdapter(str(folder), max(w.rank for w in modules.values()), modules, config)


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    """The weights file's tensors: safetensors first; a ``.bin`` only through the weights-only unpickler,
    which refuses anything but tensors and plain containers."""
    safetensors_path, bin_path = folder / ADAPTER_SAFETENSORS, folder / ADAPTER_BIN
    try:
        if safetensors_path.is_file():
            tensors = load_file(str(safetensors_path), device="cpu")
        elif bin_path.is_file():
            tensors = torch.load(str(bin_path), map_location="cpu", weights_only=True)
        else:
            raise LoRAAdapterError(f"{where}: missing weights: neither {ADAPTER_SAFETENSORS} nor {ADAPTER_BIN}")
    except LoRAAdapterError:
        raise
    except Exception as e:  # a truncated or foreign file: safetensors and the unpickler raise their own kinds
        raise LoRAAdapterError(f"{where}: cannot read its weights ({type(e).__name__}: {e})") from None
    if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in tensors.items()):
        raise LoRAAdapterError(f"{where}: {ADAPTER_BIN} must hold a dict of name -> tensor")
    return tensors


def _modules(tensors: dict[str, torch.Tensor], config: PeftLoRAConfig, base: BaseLinears, max_lora_rank: int,
             where: str) -> dict[tuple[int, str], LoRAWeights]:
    """PEFT's tensors paired into modules, each checked against its base projection."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            hint = next((what for frag, what in _TENSOR_HINTS if frag in name), "not a projection's lora_A/lora_B")
            raise LoRAAdapterError(f"{where}: unsupported tensor {name!r}: {hint}")
        layer, group, module, side = int(match[1]), match[2], match[3], match[4]
        if module not in PROJECTIONS or module_group(module) != group:
            raise LoRAAdapterError(f"{where}: unsupported target {group}.{module} (tensor {name!r}); LoRA is served "
                                   f"on {list(PROJECTIONS)}")
        if not tensor.is_floating_point():
            raise LoRAAdapterError(f"{where}: tensor {name!r} is {tensor.dtype}, not floating point")
        found.setdefault((layer, module), {})[side] = tensor
    if not found:
        raise LoRAAdapterError(f"{where}: its weights hold no LoRA tensors")
    modules = {}
    for (layer, module), pair in sorted(found.items()):
        key = f"model.layers.{layer}.{module_group(module)}.{module}"
        if len(pair) < 2:
            have, lack = ("A", "B") if "A" in pair else ("B", "A")
            raise LoRAAdapterError(f"{where}: {key} has lora_{have} but no lora_{lack}")
        features = base.features(layer, module)
        if features is None:
            why = f"layer {layer} is a MoE layer" if layer in base.moe_layers else f"it has {base.num_layers} layers"
            raise LoRAAdapterError(f"{where}: targets {key}, which the base model does not have ({why})")
        a, b = pair["A"], pair["B"]
        rank, (n_in, n_out) = config.rank_of(key), features
        if rank > max_lora_rank:
            raise LoRAAdapterError(f"{where}: {key} has rank {rank}, above max_lora_rank={max_lora_rank}")
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise LoRAAdapterError(f"{where}: wrong shapes for {key}: lora_A {tuple(a.shape)}, lora_B "
                                   f"{tuple(b.shape)}; the base projection ({n_in} -> {n_out}) at rank {rank} "
                                   f"needs lora_A {(rank, n_in)}, lora_B {(n_out, rank)}")
        modules[(layer, module)] = LoRAWeights(a.contiguous(), b.contiguous(), config.scaling_of(key))
    return modules


def shard_weights(weights: LoRAWeights, module: str, base: BaseLinears, tp: TensorParallel) -> LoRAWeights:
    """This rank's share of a module's adapter, split as the base layer is. Column-parallel (q/k/v, gate/up):
    B's output rows, A whole, so each rank's product is its slice of the output. Row-parallel (o, down): A's
    input columns, B whole, so each rank's product is a partial sum that the layer's all-reduce completes
    with the base product's."""
    if tp.size == 1:
        return weights
    start, length = base.tp_range(module, tp)
    a, b = weights.lora_a, weights.lora_b
    if module in ROW_PARALLEL:
        a = a[:, start:start + length]
    else:
        b = b[start:start + length]
    return LoRAWeights(a.contiguous(), b.contiguous(), weights.scaling)
