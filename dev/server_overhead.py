"""Host cost of serving a token: the server process's CPU time per streamed output token, the model stubbed out.

``host_overhead.py`` prices one engine step; a served token also costs the HTTP side: the engine thread hands each
step's deltas to the event loop, which turns every one into an SSE event of a chunked response, while both threads
share one GIL. On the GPU a step of the 8B shape at 256 streams takes ~30 ms of device time; if the server's host
work per step approaches it, serving is host-bound whatever the kernels do. This script measures that host work on
the CPU: a child process serves a tiny checkpoint whose forward and LM head are stubs (``host_overhead.build_engine``:
what remains is the engine's own Python and small torch ops), ``minfer bench-serve`` drives it (workload A's token-id
prompts, closed loop), and the child's CPU time (``/proc``, per thread) is divided by the tokens it streamed.

Run it on a quiet machine: the client shares the cores. Usage:
    python dev/server_overhead.py [--clients 256] [--requests 512] [--max-tokens 128] [--stream-interval N]
                                   [--engine-process] [--py-spy FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TICK = os.sysconf("SC_CLK_TCK")


STUB_HOOK = """import sys
sys.path.insert(0, {dev!r})
import minfer.engine.llm_engine as _m
_init = _m.LLMEngine.__init__


def _stubbed(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    from host_overhead import stub_model
    stub_model(self, 64)


_m.LLMEngine.__init__ = _stubbed
"""


def serve(port: int, clients: int, engine_process: bool, stream_interval: int) -> None:
    """The child: the stubbed engine behind the real app, on uvicorn; with ``engine_process`` the engine runs in a
    process of its own (the data-parallel path with one replica, stubbed there by the sitecustomize hook)."""
    import uvicorn

    sys.path.insert(0, str(HERE))
    from host_overhead import stub_config  # noqa: E402

    from minfer.engine.dp.engine import DataParallelLLMEngine
    from minfer.engine.llm_engine import LLMEngine
    from minfer.outputs import RequestOutputKind
    from minfer.server.app import build_app
    from minfer.server.http_protocol import http_protocol

    engine_class = DataParallelLLMEngine if engine_process else LLMEngine
    engine = engine_class(stub_config(clients, async_scheduling=True), RequestOutputKind.DELTA)
    app = build_app(engine, ["stub"], stream_interval=stream_interval)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                  http=http_protocol())).run()
    engine.shutdown()


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid`` and its children, by process and thread (name/id)."""
    out: dict[str, float] = {}
    pids = [pid] + [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        for thread, secs in cpu_seconds(p).items():
            name = Path(f"/proc/{p}/task/{thread}/comm").read_text().strip()
            key = f"{'api' if p == pid else 'engine'}:{name}/{thread}"
            out[key] = out.get(key, 0.0) + secs
    return out


def cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each of ``pid``'s threads."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens a request (fixed workload)")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine in a process of its own (the data-parallel path, one replica)")
    ap.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    ap.add_argument("--py-spy", default=None, metavar="FILE",
                    help="sample the server with py-spy during the run (stacks of the thread holding the GIL, "
                         "--format raw) into FILE")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.port, args.clients, args.engine_process, args.stream_interval)
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    hook = Path(tempfile.mkdtemp())
    (hook / "sitecustomize.py").write_text(STUB_HOOK.format(dev=str(HERE)))
    child_env = dict(env, PYTHONPATH=f"{hook}{os.pathsep}{env['PYTHONPATH']}")
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port), "--clients",
                              str(args.clients), "--stream-interval", str(args.stream_interval)]
                             + (["--engine-process"] if args.engine_process else []), env=child_env)
    try:
        base = f"http://127.0.0.1:{args.port}"
        sys.path.insert(0, str(HERE.parent))
        from tests.server.procs import wait_healthy  # noqa: E402

        wait_healthy(child, base, 120, lambda: "(the server's output is above)")
        with tempfile.TemporaryDirectory() as out:
            spy = None if args.py_spy is None else subprocess.Popen(
                ["py-spy", "record", "--pid", str(child.pid), "--format", "raw", "--threads", "--subprocesses",
                 "--gil", "--rate", "200", "--output", args.py_spy, "--nonblocking"], stdout=subprocess.DEVNULL)
            before, start = tree_cpu(child.pid), time.perf_counter()
            subprocess.run([sys.executable, "-m", "minfer.cli", "bench-serve", "--base-url", base, "--quiet",
                            "--workload", "fixed", "--input-len", "512", "--output-len", str(args.max_tokens),
                            "--token-id-max", "500", "--concurrency", str(args.clients), "--num-prompts",
                            str(args.requests), "--warmup", "0", "--output-dir", out], env=env, check=True)
            wall, after = time.perf_counter() - start, tree_cpu(child.pid)
            if spy is not None:
                spy.send_signal(2)  # py-spy writes its file on SIGINT
                spy.wait(60)
            result = json.loads((Path(out) / "results.json").read_text())
    finally:
        child.terminate()
        child.wait(30)
    used = sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)
    tokens = result["levels"][0]["output_tokens"]
    total = sum(s for s, _ in used)
    print(f"{args.clients} clients, {args.requests} requests x {args.max_tokens} tokens, engine "
          f"{'in its own process' if args.engine_process else 'thread in the API process'}, stream interval "
          f"{args.stream_interval}: {tokens} tokens in "
          f"{wall:.1f} s ({tokens / wall:,.0f} tok/s on this machine, client included)")
    by_process: dict[str, float] = {}
    for secs, key in used:
        by_process[key.split(":")[0]] = by_process.get(key.split(":")[0], 0.0) + secs
    print(f"server CPU {total:.2f} s = {1e6 * total / tokens:.1f} us a token ("
          + ", ".join(f"{p} {1e6 * v / tokens:.1f}" for p, v in by_process.items()) + "); busiest threads: "
          + ", ".join(f"{k} {s:.2f} s" for s, k in used[:5]))


if __name__ == "__main__":
    main()
