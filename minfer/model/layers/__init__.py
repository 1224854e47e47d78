"""The decoder's building blocks, one concern a file; every model family wires them.

Each block computes through the ``Ops`` it was built with (``minfer.ops``): HF's rounding on the torch
ops, the fused Triton kernels on the Triton ops; no block asks which. A block that is split under tensor
parallelism takes the group as ``tp`` (``SINGLE`` by default) and reads only its rank's slice of each
checkpoint tensor; a block with weights in a checkpoint format takes its method from
``minfer.model.quantization`` and never asks which format it is.
"""
