"""A data-parallel replica killed under load (issue 43): how long until /health names it, how long until the next
request succeeds, and what became of the requests in flight.

Starts ``minfer serve --data-parallel-size N`` (the flags after ``--`` go to it), waits for /health, drives it with
``minfer bench-serve`` (closed loop, fixed lengths), and ``--kill-after`` seconds into the run SIGKILLs the replica
``--victim`` (found among the server's descendants by its process name, ``minfer-dp<i>``). From the kill it polls
/health until the 503 names the replica, and a one-token completion until one succeeds. The client's results
(completed, failed: the victim's requests in flight fail with the replica's name) come from bench-serve's report.
-> ``--out``/failover.json and one markdown line on stdout.

    python benchmarks/dp_failover.py --out /tmp/fo -- --model minfer/assets/builtin-model --data-parallel-size 2
    python3 benchmarks/dp_failover.py --out $OUT/failover -- --shape llama-3.1-8b --load-format dummy \\
        --data-parallel-size 2 --max-model-len 4096     # on 2 GPUs (benchmarks/gpu_dp.sh RUNS=kill)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

POLL_S = 0.005


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (/proc's children lists, depth first)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def replica_pid(server: int, index: int) -> int:
    for pid in descendants(server):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"minfer-dp{index}":
                return pid
        except OSError:
            continue
    raise RuntimeError(f"no process named minfer-dp{index} below the server ({server})")


def get(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - the local server
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8061)
    ap.add_argument("--victim", type=int, default=1, help="the replica killed")
    ap.add_argument("--kill-after", type=float, default=5.0, help="seconds into the load")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then minfer serve's flags")
    args = ap.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{args.port}"
    with open(out / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "minfer.cli", "serve", "--port", str(args.port),
                                   "--no-access-log", "--uvicorn-log-level", "warning", *serve_args],
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + args.start_timeout
        while get(base + "/health")[0] != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: see {out / 'server.log'}")
            time.sleep(0.5)
        model = get(base + "/v1/models")[1]["data"][0]["id"]
        with open(out / "bench.log", "w") as log:
            bench = subprocess.Popen([sys.executable, "-m", "minfer.cli", "bench-serve", "--base-url", base, "--quiet",
                                      "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                                      "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                                      "--warmup", "0", "--output-dir", str(out / "bench")],
                                     stdout=log, stderr=subprocess.STDOUT)
        time.sleep(args.kill_after)
        victim = replica_pid(server.pid, args.victim)
        running = get(base + "/stats")[1]["replicas"][args.victim]["num_running"]
        os.kill(victim, signal.SIGKILL)
        killed = time.perf_counter()
        name = f"data-parallel replica {args.victim} died"
        while True:
            status, health = get(base + "/health")
            if status == 503 and name in (health or {}).get("error", ""):
                named = time.perf_counter() - killed
                break
            if time.perf_counter() - killed > 60:
                raise RuntimeError(f"/health did not name replica {args.victim} within 60 s: {status} {health}")
            time.sleep(POLL_S)
        while True:
            status, _ = get(base + "/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 1})
            if status == 200:
                served = time.perf_counter() - killed
                break
            if time.perf_counter() - killed > 60:
                raise RuntimeError(f"no completion succeeded within 60 s of the kill (last status {status})")
            time.sleep(POLL_S)
        bench.wait(args.start_timeout)
        level = json.loads((out / "bench" / "results.json").read_text())["levels"][0]
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    result = {"victim": args.victim, "running_on_victim_at_kill": running, "health_names_it_s": round(named, 4),
              "next_request_ok_s": round(served, 4), "completed": level["completed"], "failed": level["failed"],
              "failed_errors": sorted({e.split(":")[-1].strip()[:120] for e in level["errors"]})[:3],
              "output_tok_s": level["output_tok_s"], "serve_args": serve_args}
    (out / "failover.json").write_text(json.dumps(result, indent=2))
    print(f"| replica {args.victim} killed ({running} running on it) | /health names it after "
          f"{1e3 * named:.0f} ms | next request served {1e3 * served:.0f} ms after the kill | "
          f"{level['completed']} completed, {level['failed']} failed of {args.num_prompts} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
