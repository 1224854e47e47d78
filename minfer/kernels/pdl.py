"""Programmatic dependent launch (PDL, Hopper and newer): a kernel's programs start while the kernel
before it drains, and wait in hardware for its results.

In a CUDA-graph decode step the GPU runs a chain of short kernels (at batch 1, seven per layer,
each a few microseconds), and every boundary costs the next kernel's launch and ramp-up while the
previous one's last programs finish. Launched with ``launch_pdl=True``, a kernel that calls
:func:`wait_for_previous` first has its programs resident before the previous kernel completes;
the wait returns once that kernel has finished and its writes are visible. Everything a kernel
does before the wait must not depend on the previous kernel (the matrix-vector kernel loads its
first weight tile there: weights never change). ``MINFER_PDL=0`` turns it off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ._utils import interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off (see use_pdl)
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    # NVIDIA only: ROCm builds also report device type "cuda" (and MI300 a major capability of 9).
    return gdc_wait is not None and torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA sm_90+, compiled (not the interpreter)."""
    if device.type != "cuda" or interpreting() or os.environ.get("MINFER_PDL", "1") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords: ``launch_pdl`` only when on (the interpreter knows no such option)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel's writes are visible, then let the next kernel's
    programs launch (they in turn wait for this whole kernel). A no-op otherwise. Releasing them
    only after the wait measured faster at batch 1 than releasing them first."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
