"""Find a checkpoint (local folder or HF hub id) and load its safetensors into the engine's model.

Shards are read one tensor at a time straight into the (fused) parameters, so host memory never
holds a second full copy of the weights. Each tensor is opened as a memory-mapped slice and a layer
reads only the rows or columns its tensor-parallel rank holds (``FusedLinear.load_shard``,
``VocabParallelEmbedding.load_shard``): no rank reads the whole model. A tensor that stacks a fused layer's
matrices (Phi-3's ``qkv_proj``, the family's ``stacked_modules``) fills each shard in turn, each reading
only this rank's rows of it; so does a tensor that stacks every expert's matrices (``stacked_experts``), once per
expert. ``load_format="dummy"`` feeds random tensors drawn on the device
(``random_weights``) down the same path instead.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.quantization import resolve_quantization
from minfer.model.random_weights import random_tensors
from minfer.model.registry import model_class
from minfer.ops import Ops


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None,
                       load_format: str = "auto") -> Path:
    """A local folder as is; otherwise an HF hub id, downloaded (config, tokenizer, safetensors; without the
    safetensors for ``load_format="dummy"``, which draws the weights instead)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        raise FileNotFoundError(f"model {model!r} is a file; pass the folder that holds it (config.json, "
                                f"*.safetensors and the tokenizer files): {str(path.parent) or '.'}")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model path {model!r} does not exist (expected a folder with config.json "
                                f"and *.safetensors, or a Hugging Face hub id like 'org/name')")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.model", "*.txt", "*.jinja"] + ([] if load_format == "dummy" else ["*.safetensors"])
    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=download_dir, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown id, gated repo ...
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = "HF_HUB_OFFLINE=1 is set and it is not in the local cache" if offline else \
            "no local folder has this name, so it was taken as a Hugging Face hub id, which could not be " \
            "downloaded (offline, or an unknown id)"
        raise FileNotFoundError(f"model {model!r}: {hint}: {type(exc).__name__}: {exc}") from exc


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (other formats are not supported)")
    return files


def load_weights(model: nn.Module, model_dir: Path, device: torch.device, load_format: str = "auto") -> None:
    """Copy every checkpoint tensor into its parameter; fail if any parameter stays unloaded.

    ``load_format="dummy"`` skips the safetensors. It takes the tensors a checkpoint of the model's config
    would hold (``random_weights``), drawn on ``device`` (the model's), and feeds them down the same path as
    a file's tensors. So tensor-parallel slicing, online quantization, expert stacking and the
    missing-tensor check all run as they would for a real checkpoint."""
    loaded: set[str] = set()
    tensors = _dummy_tensors(model, device) if load_format == "dummy" else _checkpoint_tensors(model_dir)
    stacked = model.stacked_modules(model.config)
    for stored, source, where in tensors:
        name = model.checkpoint_name(stored)
        if name is None or "rotary_emb" in name:
            continue  # another modality's tower or projector, or a buffer: never read
        targets = _targets(model, name, stacked)
        if not targets:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # some tied checkpoints still store it
            raise ValueError(f"unexpected tensor {name!r} in {where}")
        for module_name, attr, shard in targets:  # several: a stacked tensor fills each of its shards
            module = model.get_submodule(module_name)
            if hasattr(module, "load_shard"):
                try:
                    attr = module.load_shard(attr, source, shard) or attr
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
            else:  # replicated (norms)
                param = getattr(module, attr)
                tensor = source[:]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(f"{module_name}.{attr}" + ("" if shard is None else f"#{shard}"))
    expected = set()
    for pname, param in model.named_parameters():
        module_name, attr = pname.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if hasattr(module, "checkpoint_keys"):  # stacked: every checkpoint matrix (and its format's tensors)
            expected |= {f"{module_name}.{a}#{i}" for a, i in module.checkpoint_keys()}
        else:
            expected.add(pname)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, Any, str]]:
    """(name, memory-mapped slice, file name) of every tensor in the folder's safetensors: indexing a
    slice reads only that part of the file."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name), file.name


def _dummy_tensors(model: nn.Module, device: torch.device) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, "dummy weights") of random weights drawn on ``device``. A tensor slices
    like a safetensors slice (``source[rows]``, ``source[:, cols]``), so ``load_shard`` takes it as it is.
    Every tensor-parallel rank draws the same whole tensors from the same seed and keeps its own slice."""
    for name, tensor in random_tensors(model.config, device):
        yield name, tensor, "dummy weights"


def _targets(model: nn.Module, name: str,
             stacked: dict[str, tuple[str, list[int]]]) -> list[tuple[str, str, int | None]]:
    """Map an HF tensor name to the (module path in our model, attribute, shard index or None) it fills: one,
    or one per shard for a tensor that stacks a fused layer's matrices (the family's ``stacked_modules``);
    none for a name the model does not have."""
    if name.startswith("model."):
        name = name[len("model."):]
    elif name == "lm_head.weight":
        return [] if model.config.tie_word_embeddings else [("lm_head", "weight", None)]
    module_name, attr = name.rsplit(".", 1)
    parts = ["mlp" if p == model.moe_block else p for p in module_name.split(".")]  # the family's MoE block name
    if len(parts) >= 3 and parts[-3] == "experts" and parts[-1] in model.expert_matrices:  # an expert's matrix
        matrix = model.expert_matrices[parts[-1]] + ("" if attr == "weight" else f".{attr}")  # and its scales
        return [(".".join(parts[:-3]), matrix, int(parts[-2]))]
    if parts[-1] == "experts" and attr in model.stacked_experts:  # every expert's matrices in one tensor
        block = ".".join(parts[:-1])
        return [(block, m, e) for m in model.stacked_experts[attr] for e in range(model.config.num_experts)]
    module_name = ".".join(parts)
    if parts[-1] in stacked:
        fused, sizes = stacked[parts[-1]]
        return [(".".join(parts[:-1] + [fused]), attr, shard) for shard in range(len(sizes))]
    if parts[-1] in model.packed_modules:
        fused, shard = model.packed_modules[parts[-1]]
        return [(".".join(parts[:-1] + [fused]), attr, shard)]
    try:
        model.get_submodule(module_name)
    except AttributeError:
        return []
    return [(module_name, attr, None)]


@torch.no_grad()
def build_model(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_position: int,
                ops: Ops, tp: TensorParallel = SINGLE, quantization: str | None = None,
                load_format: str = "auto") -> nn.Module:
    """The model on ``device``, computing with ``ops`` (``minfer.ops.select_ops``), weights loaded;
    under tensor parallelism, rank ``tp.rank``'s shard of it. ``quantization``: the engine's request
    (a method of ``quantization.ONLINE_FORMATS``, applied to a float checkpoint as it loads); a quantized
    checkpoint says so in its config.
    ``load_format``: 'auto' reads the safetensors, 'dummy' draws random weights (``load_weights``)."""
    quant = resolve_quantization(config.quantization_config, quantization)
    if load_format == "dummy" and config.quantization_config is not None and not quant.random_weights:
        raise ValueError(f"load_format='dummy' does not draw pre-quantized {quant.name} tensors (config.json has a "
                         "quantization_config): drop it from the config, and pass the engine's quantization argument for "
                         "weights quantized as they load")
    with torch.device(device):
        model = model_class(config.architecture)(config, dtype, max_position, ops, tp, quant)
    load_weights(model, model_dir, device, load_format)
    return model.eval()
