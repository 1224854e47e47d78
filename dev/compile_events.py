"""Which Triton / Gluon kernels compile while ``minfer`` runs, and when: each JIT cache miss (a variant not yet
in this process, whether then loaded from Triton's disk cache or compiled) printed with the seconds since start,
between the engine's own start-up log lines, so that variants compiled after start-up show. Arguments: those of
``minfer bench`` (the run to watch).

    python dev/compile_events.py --shape qwen3-0.6b --kv-cache-dtype int8 --load-format dummy
"""
from __future__ import annotations

import sys
import time

import triton

START = time.perf_counter()


def _hook(*args, **kwargs) -> bool:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
    print(f"[{time.perf_counter() - START:7.2f} s] JIT miss {name}: {str(kwargs.get('repr', ''))[:400]}",
          file=sys.stderr, flush=True)
    return False


if hasattr(triton, "knobs") and hasattr(triton.knobs.runtime, "jit_cache_hook"):
    triton.knobs.runtime.jit_cache_hook = _hook
else:
    from triton.runtime.jit import JITFunction

    JITFunction.cache_hook = _hook

if __name__ == "__main__":
    from minfer.cli import main

    sys.exit(main(["-v", "bench", *sys.argv[1:]]))
