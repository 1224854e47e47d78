"""Which Triton kernels compile (or load from the disk cache) during ``minfer bench``'s timed run.

Every new specialisation of a kernel (a new constexpr set, or an int argument that newly equals 1 or becomes
divisible by 16) costs a compile, ~0.1-2 s, or a disk-cache load, in the process that meets it first. Those met
only inside the timed ``generate`` are paid by the measurement (and by a server's first requests). This wraps
Triton's per-specialisation compile step, runs the bench and lists the specialisations met while timing.

    python benchmarks/compile_watch.py bench --shape qwen3-0.6b      # any minfer CLI arguments
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from triton.runtime.jit import JITFunction  # noqa: E402

import minfer.benchmark.offline as offline  # noqa: E402
from minfer.cli import main  # noqa: E402

EVENTS: list[tuple[float, str, float, str]] = []
TIMED: list[float] = []
_compile = JITFunction._do_compile
_run = offline.run_throughput


def _watched_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    t0 = time.perf_counter()
    kernel = _compile(self, key, signature, device, constexprs, options, attrs, warmup)
    EVENTS.append((t0, self.__name__, time.perf_counter() - t0, str(key)[:160]))
    return kernel


def _watched_run(*args, **kwargs):
    TIMED.append(time.perf_counter())
    try:
        return _run(*args, **kwargs)
    finally:
        TIMED.append(time.perf_counter())


JITFunction._do_compile = _watched_compile
offline.run_throughput = _watched_run

if __name__ == "__main__":
    rc = main(sys.argv[1:])
    print(f"{len(EVENTS)} specialisations in the process, {sum(e[2] for e in EVENTS):.2f} s")
    if len(TIMED) >= 2:
        inside = [e for e in EVENTS if TIMED[0] <= e[0] <= TIMED[1]]
        print(f"{len(inside)} inside the timed run ({TIMED[1] - TIMED[0]:.2f} s), {sum(e[2] for e in inside):.2f} s:")
        for t0, name, sec, key in inside:
            print(f"  +{t0 - TIMED[0]:.2f} s  {name}  {sec * 1e3:.0f} ms  {key}")
    sys.exit(rc)
