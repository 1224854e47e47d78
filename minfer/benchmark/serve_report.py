"""Summaries of a bench-serve level (throughput, TTFT/TPOT/ITL percentiles), the table, the plot.

Definitions follow vLLM's serving benchmark so numbers compare: TTFT is send to first token
chunk; TPOT is (latency - TTFT) / (output tokens - 1) per request; ITL is every gap between
successive chunks of a request, pooled over requests. Throughput divides by the level's wall
time, first send to last byte.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's percentile (linear interpolation, as vLLM's benchmark), NaN for a level with no samples
    (every request failed) where numpy would raise."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _dist_ms(values: Sequence[float]) -> dict[str, float]:
    out = {f"p{q}": round(percentile(values, q) * 1000, 3) for q in PERCENTILES}
    out["mean"] = round(sum(values) / len(values) * 1000, 3) if values else float("nan")
    return out


def summarize(results: Sequence[Any], elapsed: float) -> dict[str, Any]:
    """``results``: RequestResult records of one level; ``elapsed``: its wall time in seconds."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": round(elapsed, 3),
        "request_throughput": round(len(ok) / elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1),
        "total_tok_s": round((out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed, 1),
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "ttft_ms": _dist_ms([r.ttft for r in ok]),
        "tpot_ms": _dist_ms(tpot),
        "itl_ms": _dist_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": _dist_ms([r.latency for r in ok]),
    }


def print_table(levels: list[dict[str, Any]], key: str) -> None:
    head = (f"{key:>11} {'ok':>5} {'req/s':>7} {'out tok/s':>10} " +
            " ".join(f"{m}{q:>3}".rjust(9) for m in ("TTFT", "TPOT", "ITL") for q in PERCENTILES))
    print(head)
    print("-" * len(head))
    for lv in levels:
        cells = " ".join(f"{lv[m + '_ms'][f'p{q}']:9.1f}" for m in ("ttft", "tpot", "itl") for q in PERCENTILES)
        print(f"{lv[key]:>11} {lv['completed']:>5} {lv['request_throughput']:7.2f} {lv['output_tok_s']:10.1f} {cells}")
    print("(latencies in ms)")


def plot(levels: list[dict[str, Any]], key: str, path: Path, title: str = "") -> Path | None:
    """TTFT, TPOT and ITL percentiles and throughput against the level; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    xs = [lv[key] for lv in levels]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, metric, label in zip(axes.flat, ("ttft", "tpot", "itl"), ("TTFT", "TPOT", "ITL")):
        for q, style in zip(PERCENTILES, ("-o", "--s", ":^")):
            ax.plot(xs, [lv[metric + "_ms"][f"p{q}"] for lv in levels], style, label=f"p{q}")
        ax.set_title(f"{label} (ms)")
        ax.set_ylabel("ms")
    ax = axes.flat[3]
    ax.plot(xs, [lv["output_tok_s"] for lv in levels], "-o", color="tab:green", label="output tok/s")
    ax.set_title("throughput")
    ax.set_ylabel("output tok/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [lv["request_throughput"] for lv in levels], "--s", color="tab:purple", label="req/s")
    ax2.set_ylabel("req/s")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    for ax in axes.flat:
        if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.set_xlabel("concurrent clients" if key == "concurrency" else "request rate (req/s)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[:3]:
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
