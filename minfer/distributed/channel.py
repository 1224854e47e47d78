"""The engine → workers channel: each command and its integer arrays as one packed int64 tensor,
broadcast from rank 0 over a gloo group (on the host, also when the model's collectives run on NCCL).

A worker needs a step's host arrays (ids, positions, slots, block tables, lengths) to run the same
forward as rank 0; they travel as numbers in a tensor, never as pickled Python objects. A message
fits one broadcast of ``CAPACITY`` words up to a few hundred sequences; a longer one (wide block
tables) sends the rest in a second. A worker's wait for the next message has no time limit, since
it may idle for hours between requests; rank 0's send (which gloo completes only once the worker
receives) has ``send_timeout``. A peer that dies closes its socket and fails either at once.

Layout: ``[total words, command, number of arrays, (ndim, *shape) per array, payloads...]``.
"""
from __future__ import annotations

from datetime import timedelta
from enum import IntEnum

import numpy as np
import torch

CAPACITY = 4096  # words of the first broadcast (32 KiB)
NO_TIMEOUT = timedelta(days=365 * 100)


class Command(IntEnum):
    STEP = 1  # run a step's forward (and its LM-head gathers) on these inputs
    COPY_BLOCKS = 2  # copy KV blocks src -> dst (copy on write)
    SHUTDOWN = 3
    DRAFT = 4  # run the draft model's forward (and its LM-head gather) on these inputs: speculative decoding
    LORA = 5  # write a LoRA adapter (slot, id, name, path) into a slot, as rank 0 did: multi-LoRA serving


def pack(command: int, arrays: list[np.ndarray]) -> np.ndarray:
    header = [0, int(command), len(arrays)]
    for a in arrays:
        header += [a.ndim, *a.shape]
    words = np.concatenate([np.array(header, dtype=np.int64)] + [a.ravel().astype(np.int64) for a in arrays])
    words[0] = len(words)
    return words


def unpack(words: np.ndarray) -> tuple[Command, list[np.ndarray]]:
    command, count = Command(int(words[1])), int(words[2])
    at, shapes = 3, []
    for _ in range(count):
        ndim = int(words[at])
        shapes.append(tuple(int(d) for d in words[at + 1:at + 1 + ndim]))
        at += 1 + ndim
    arrays = []
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        arrays.append(words[at:at + n].reshape(shape).copy())
        at += n
    return command, arrays


class StepChannel:
    """Rank 0 ``send``s; every other rank ``recv``s the same messages in the same order."""

    def __init__(self, group: object, send_timeout: float) -> None:
        self.group = group
        self.send_timeout = timedelta(seconds=send_timeout)
        self._first = torch.zeros(CAPACITY, dtype=torch.int64)

    def send(self, command: Command, arrays: list[np.ndarray] = ()) -> None:
        words = pack(command, list(arrays))
        first = self._first.numpy()
        head = min(len(words), CAPACITY)
        first[:head] = words[:head]
        self._broadcast(self._first)
        if len(words) > CAPACITY:
            self._broadcast(torch.from_numpy(words[CAPACITY:]))

    def _broadcast(self, t: torch.Tensor) -> None:
        torch.distributed.broadcast(t, 0, group=self.group, async_op=True).wait(timeout=self.send_timeout)

    def recv(self) -> tuple[Command, list[np.ndarray]]:
        torch.distributed.broadcast(self._first, 0, group=self.group)
        first = self._first.numpy()
        total = int(first[0])
        if total <= CAPACITY:
            return unpack(first[:total])
        rest = torch.empty(total - CAPACITY, dtype=torch.int64)
        torch.distributed.broadcast(rest, 0, group=self.group)
        return unpack(np.concatenate([first, rest.numpy()]))
