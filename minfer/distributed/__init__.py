"""Tensor parallelism's communication: the rank's view of its group (``TensorParallel``) and the
channel that carries each step's inputs from the engine to the workers (``StepChannel``).

Both sit on ``torch.distributed``: NCCL between GPUs, gloo on the CPU and for the channel."""
from minfer.distributed.channel import Command, StepChannel
from minfer.distributed.parallel import SINGLE, TensorParallel

__all__ = ["SINGLE", "Command", "StepChannel", "TensorParallel"]
