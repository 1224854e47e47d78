"""What the tensor-parallel step channel costs rank 0: one decode step's inputs sent to N-1 workers.

Rank 0 sends a decode STEP message (``StepArrays.message`` of B sequences, block tables W wide) down
``minfer.distributed.StepChannel`` (gloo broadcast of one packed int64 tensor) while the workers
``recv``; the table gives rank 0's time per send (median, p90), next to ``broadcast_object_list`` of
the same arrays (pickled) for reference. CPU only; run on the GPU host to see its cores' figure:

    python3 benchmarks/tp_channel.py [--world 2] [--iters 300]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minfer.distributed import Command, StepChannel

CASES = [(1, 64), (64, 256), (256, 256)]  # (sequences, block-table width)


def _message(b: int, width: int) -> list[np.ndarray]:
    i64 = np.arange(b, dtype=np.int64)
    return [i64, i64 + 100, i64 + 1000, np.zeros((b, width), dtype=np.int32), np.full(b, 4000, np.int32),
            np.ones(b, np.int64), np.arange(b + 1, dtype=np.int64), i64, i64, i64, np.array([b]),
            np.zeros((0, 2), np.int64)]


def _run(rank: int, world: int, port: int, iters: int, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    channel = StepChannel(dist.new_group(backend="gloo", timeout=timedelta(days=1)), 30.0)
    for b, width in CASES:
        arrays = _message(b, width)
        for kind in ("channel", "pickled"):
            times = []
            dist.barrier()
            for _ in range(iters):
                if rank == 0:
                    started = time.perf_counter()
                    if kind == "channel":
                        channel.send(Command.STEP, arrays)
                    else:
                        dist.broadcast_object_list([arrays], 0, group=channel.group)
                    times.append(time.perf_counter() - started)
                    time.sleep(0.0005)  # the engine's own work between steps
                elif kind == "channel":
                    channel.recv()
                else:
                    box = [None]
                    dist.broadcast_object_list(box, 0, group=channel.group)
            if rank == 0:
                times.sort()
                results[(b, width, kind)] = (statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_run, args=(args.world, port, args.iters, results), nprocs=args.world)
    print(f"step channel, rank 0's time per send to {args.world - 1} worker(s), {os.cpu_count()} cores")
    print("| sequences | table width | message KiB | channel median / p90 µs | pickled median / p90 µs |")
    print("|---:|---:|---:|---:|---:|")
    for b, width in CASES:
        kib = sum(a.size for a in _message(b, width)) * 8 / 1024
        c, p = results[(b, width, "channel")], results[(b, width, "pickled")]
        print(f"| {b} | {width} | {kib:.1f} | {c[0]:.0f} / {c[1]:.0f} | {p[0]:.0f} / {p[1]:.0f} |")


if __name__ == "__main__":
    main()
