"""``torchrun --nproc-per-node 2 -m minfer.cli generate ... --tensor-parallel-size 2``: every rank runs the
command, rank 0 prints, the others serve as workers and exit with it; the text is one process's."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from minfer.cli import main as cli_main

if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc", allow_module_level=True)

PROMPT = "def fibonacci(n):"
GREEDY = ["--temperature", "0", "--max-tokens", "16", "--num-kv-blocks", "32"]
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint (4 heads, 2 KV heads: it shards over 2), not the session's five."""
    path = Path(__file__).resolve().parent.parent / "conftest.py"  # by path: ``conftest`` may name another folder's
    spec = importlib.util.spec_from_file_location("_minfer_tests_root_conftest", path)
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)  # type: ignore[union-attr]
    return root.make_checkpoint(tmp_path_factory.mktemp("torchrun") / "llama3", "llama3")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process; None when it is gone or a zombie (it has exited)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] in "ZX" else (int(fields[1]), int(fields[19]))


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live process below ``root``."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)] = st
    found, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in parents.items() if ppid in frontier and pid not in found}
        found.update({pid: parents[pid][1] for pid in frontier})
    return found


def _torchrun(model: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[int, int], list[int]]:
    """Run ``minfer generate`` under torchrun (2 ranks); return what it printed, every process it started
    (torchrun puts each rank in a session of its own, so they are found by parentage while it runs) and
    those still running 10 s after it exited (then killed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "minfer.cli", "generate", "--model", str(model), *GREEDY, *args, PROMPT]
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # files: nobody reads a pipe while it runs
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
    seen: dict[int, int] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"torchrun still running after {TIMEOUT_S:.0f} s"
            seen.update(_descendants(proc.pid))
            time.sleep(0.05)
        left = _left_after(seen, grace_s=10.0)
    finally:
        for pid, start in seen.items():
            if (st := _stat(pid)) is not None and st[1] == start:
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    return subprocess.CompletedProcess(cmd, proc.returncode, *texts), seen, left


def _left_after(seen: dict[int, int], grace_s: float) -> list[int]:
    """Which of ``seen`` (pid -> start time) still run after up to ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [pid for pid, start in seen.items() if (st := _stat(pid)) is not None and st[1] == start]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_torchrun_prints_what_one_process_prints(model: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["generate", "--model", str(model), *GREEDY, PROMPT]) == 0
    expected = capsys.readouterr().out
    assert expected.startswith(PROMPT) and len(expected) > len(PROMPT) + 1

    run, seen, left = _torchrun(model, "--tensor-parallel-size", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == expected, run.stderr  # rank 0's text only: rank 1 printed nothing
    assert run.stderr.count("minfer generate: sampling with") == 1, run.stderr
    assert len(seen) >= 2, seen  # the two ranks (and whatever else torchrun started) ...
    assert left == [], f"left behind by torchrun: {left}"  # ... all ended with it


def test_a_size_that_is_not_the_world_size_fails_clearly(model: Path) -> None:
    run, seen, left = _torchrun(model, "--tensor-parallel-size", "1")
    assert run.returncode != 0
    assert "tensor_parallel_size (1) must equal torchrun's WORLD_SIZE (2)" in run.stderr, run.stderr
    assert "minfer/engine/" not in run.stderr, run.stderr  # the CLI's one-line error, not a traceback through us
    assert run.stdout == "" and left == [], left
