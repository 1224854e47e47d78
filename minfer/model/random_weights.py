"""Random weights for a model config, named as a checkpoint names them: N(0, 0.02), norm weights 1.

The same code serves two users. ``minfer.benchmark.shapes`` writes these weights to safetensors as a
real HF folder. ``load_format="dummy"`` draws them on the target device while the model loads, for
shapes whose checkpoint does not fit on the disk (qwen3-30b-a3b: 61 GB, mixtral-8x7b: 93 GB). Both
draw in the same order from a generator with the same seed. So a dummy load equals loading the
checkpoint written with the same seed on the same kind of device (a CUDA generator's numbers are not
the CPU's). Throughput does not depend on the values, only on the shapes. The values are kept small
so that activations stay finite through every layer.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from minfer.config import ModelConfig
from minfer.model.registry import model_class

STD = 0.02  # the weights' standard deviation (HF's initializer_range)
SEED = 0  # the dummy load's seed; write_random_checkpoint's default


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``config`` holds, name -> shape, in drawing order (its family's
    ``checkpoint_shapes``)."""
    return model_class(config.architecture).checkpoint_shapes(config)


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint of float ``dtype`` stores tensor ``name`` in: uint8 for MXFP4 codes and scales."""
    return torch.uint8 if name.endswith(("_blocks", "_scales")) else dtype


def draw(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype,
         device: torch.device | str) -> torch.Tensor:
    """One tensor on ``device``. A norm weight is 1 and uses no numbers from ``gen``: a random norm
    would only rescale its layer. MXFP4 codes and scales (``*_blocks``, ``*_scales``) are random bytes.
    Any other tensor is drawn in float32 from ``gen``, times STD, then rounded to ``dtype``, as a
    checkpoint stores it."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if stored_dtype(name, dtype) == torch.uint8 and name.endswith("_blocks"):  # MXFP4 codes: any byte is two e2m1
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)
    if name.endswith("_scales"):  # MXFP4 exponents near 2^-7: |w| ~ 0.02 on average, as the float tensors
        return torch.randint(119, 122, shape, generator=gen, device=device, dtype=torch.uint8)
    return (torch.randn(shape, generator=gen, device=device) * STD).to(dtype)


def random_tensors(config: ModelConfig, device: torch.device | str,
                   seed: int = SEED) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of ``config``. Each is drawn on ``device`` in the
    checkpoint's dtype (``config.torch_dtype``) only when the loop reaches it, so only one tensor
    exists at a time beside the model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in tensor_shapes(config).items():
        yield name, draw(name, shape, gen, config.torch_dtype, device)
