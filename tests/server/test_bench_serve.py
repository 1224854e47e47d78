"""``minfer bench-serve``: against a running server, and launching its own (the one-command path)."""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from minfer.benchmark.serve_report import percentile
from minfer.cli.bench_serve import add_bench_serve_parser

FIXED = ["--workload", "fixed", "--input-len", "24", "--output-len", "12", "--token-id-max", "299", "--quiet"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench-serve", *argv])


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert abs(percentile(list(map(float, range(101))), 90) - 90.0) < 1e-9


def test_bench_against_running_server(server: Any, tmp_path: Path, capsys: Any) -> None:
    from minfer.benchmark.serve import run

    args = _parse(["--base-url", server.base_url, "--concurrency", "1,4", "--num-prompts", "6",
                   "--output-dir", str(tmp_path), *FIXED])
    assert run(args) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    for lv in report["levels"]:
        assert lv["completed"] == 6 and lv["failed"] == 0
        assert lv["output_tokens"] == 6 * 12 and lv["prompt_tokens"] == 6 * 24
        assert lv["output_tok_s"] > 0 and lv["request_throughput"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 < lv[metric]["p50"] <= lv[metric]["p90"] <= lv[metric]["p99"]
    assert (tmp_path / "latency.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "TTFT 50" in table and "out tok/s" in table


def test_bench_at_a_request_rate(server: Any, tmp_path: Path) -> None:
    from minfer.benchmark.serve import run

    args = _parse(["--base-url", server.base_url, "--request-rate", "50", "--max-concurrency", "4",
                   "--num-prompts", "5", "--warmup", "0", "--output-dir", str(tmp_path), *FIXED])
    assert run(args) == 0
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert level["rate"] == 50.0 and level["completed"] == 5


def test_bench_launches_its_own_server(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minfer.cli", "bench-serve", "--launch", "--model", str(tiny_model),
           "--port", str(port), "--num-kv-blocks", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
           "--concurrency", "2", "--num-prompts", "4", "--warmup", "1", "--output-dir", str(tmp_path), *FIXED]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert level["completed"] == 4 and level["output_tokens"] == 4 * 12
    with socket.socket() as s:  # the launched server is gone again
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_bad_arguments_and_an_unreachable_server_are_clear_errors(capsys: Any) -> None:
    from minfer.cli import main

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens here now
    url = f"http://127.0.0.1:{port}"
    for extra, message in ((["--concurrency", "0"], "--concurrency values must be > 0"),
                           (["--concurrency", "abc"], "--concurrency must be comma-separated numbers"),
                           (["--request-rate", "-1"], "--request-rate values must be > 0"),
                           (["--num-prompts", "0"], "--num-prompts must be >= 1"),
                           ([], "cannot reach a server")):
        assert main(["bench-serve", "--base-url", url, "--quiet", *extra]) == 2
        assert message in capsys.readouterr().err


def test_prompt_ids_fit_the_served_vocabulary(server: Any, tmp_path: Path) -> None:
    """Without --token-id-max, the ids come from the served model's vocabulary (the test model's is far below
    the old default of 10,000, which made every request fail as out-of-vocabulary)."""
    from minfer.benchmark.serve import run, served_token_id_max

    vocab = server.stats()["vocab_size"]
    assert served_token_id_max(server.base_url) == vocab - 1 < 10_000
    args = _parse(["--base-url", server.base_url, "--concurrency", "2", "--num-prompts", "4", "--warmup", "0",
                   "--workload", "fixed", "--input-len", "24", "--output-len", "4", "--quiet",
                   "--output-dir", str(tmp_path)])
    assert args.token_id_max is None and run(args) == 0 and args.token_id_max == vocab - 1
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["levels"][0]["completed"] == 4 and report["levels"][0]["failed"] == 0


def test_the_default_workload_fits_the_served_context(server: Any, tmp_path: Path) -> None:
    """Workload A asks for up to 2,048 tokens; against a smaller context (the built-in model's 1,024: 3 of 4
    requests were 400s) its lengths are scaled to the max_model_len that /v1/models lists."""
    from minfer.benchmark.serve import run, served_model

    max_len = served_model(server.base_url)[1]
    assert max_len is not None and max_len < 2048
    args = _parse(["--base-url", server.base_url, "--concurrency", "2", "--num-prompts", "4", "--warmup", "0",
                   "--quiet", "--output-dir", str(tmp_path)])
    assert run(args) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["max_model_len"] == max_len and report["workload"] == f"a (lengths x {max_len}/2048 for " \
        f"max_model_len {max_len})"
    assert report["levels"][0]["completed"] == 4 and report["levels"][0]["failed"] == 0


def test_lengths_choose_the_fixed_workload_and_conflicts_are_named(server: Any) -> None:
    """--input-len / --output-len were ignored unless --workload fixed: they now choose it, and beside an explicit
    --workload a they are an error naming both."""
    from minfer.benchmark.serve import parse_levels, run

    args = _parse(["--input-len", "24"])
    parse_levels(args)
    assert (args.workload, args.input_len, args.output_len) == ("fixed", 24, 128)
    args = _parse([])
    parse_levels(args)
    assert (args.workload, args.input_len, args.output_len) == ("a", None, None)
    with pytest.raises(ValueError, match="--output-len set the fixed workload's lengths, but --workload a"):
        parse_levels(_parse(["--workload", "a", "--output-len", "8"]))
    too_long = _parse(["--base-url", server.base_url, "--input-len", "500", "--output-len", "100", "--quiet"])
    with pytest.raises(ValueError, match="do not fit the served model's max_model_len"):
        run(too_long)


def test_prefix_repetition_shares_prefixes_and_reports_the_cache_hits(server: Any, tmp_path: Path) -> None:
    """--workload prefix-repetition: every prompt is one of the level's --num-prefixes prefixes, then tokens of its
    own; each level draws its own prefixes; the report gives the level's prefix-cache hits from the server's
    counters, which a fixed workload's unrelated prompts do not get. Its flags elsewhere are an error."""
    from minfer.benchmark.serve import build_requests, parse_levels, run

    args = _parse(["--workload", "prefix-repetition", "--prefix-len", "64", "--num-prefixes", "2",
                   "--input-len", "16", "--output-len", "4", "--token-id-max", "299"])
    parse_levels(args)
    bodies = build_requests(args, 8, 0)
    heads = {tuple(b["prompt"][:64]) for b in bodies}
    assert len(heads) == 2 and all(len(b["prompt"]) == 80 for b in bodies)
    assert sum(tuple(b["prompt"][:64]) == min(heads) for b in bodies) == 4
    assert len({tuple(b["prompt"][64:]) for b in bodies}) == 8
    assert not heads & {tuple(b["prompt"][:64]) for b in build_requests(args, 8, 1)}  # another level, others
    with pytest.raises(ValueError, match="--prefix-len shape the prefix-repetition workload"):
        parse_levels(_parse(["--prefix-len", "64"]))
    with pytest.raises(ValueError, match="--num-prefixes must be >= 1"):
        parse_levels(_parse(["--workload", "prefix-repetition", "--num-prefixes", "0"]))

    levels = {}
    for name, flags in (("shared", ["--workload", "prefix-repetition", "--prefix-len", "64", "--num-prefixes", "2",
                                    "--input-len", "16", "--output-len", "4"]), ("fixed", FIXED)):
        out = tmp_path / name
        flags = [f for f in flags if f not in ("--quiet", "--token-id-max", "299")]
        assert run(_parse(["--base-url", server.base_url, "--concurrency", "2", "--num-prompts", "8", "--quiet",
                           "--token-id-max", "299", "--output-dir", str(out), *flags])) == 0
        (levels[name],) = json.loads((out / "results.json").read_text())["levels"]
    shared = levels["shared"]
    # 8 prompts of 5 blocks: the first of each prefix misses (and one beside it, two clients running at once), the
    # others find its 4 blocks
    assert shared["prefix_cache_hit_tokens"] >= 4 * 64 and shared["prefix_cache_hit_rate"] >= 0.4, shared
    assert levels["fixed"]["prefix_cache_hit_rate"] < 0.1
