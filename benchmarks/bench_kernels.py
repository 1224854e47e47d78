"""Benchmark the Triton kernels against their torch references and SDPA on one GPU.

Per kernel and shape: median time (``triton.testing.do_bench``, which also flushes the L2 before
every repetition, so each run reads cold data), bytes/s as a share of the measured 4.22 TB/s copy
ceiling and FLOP/s as a share of the measured 793 TFLOP/s bf16 matmul ceiling (BENCHMARKS.md).
Every shape is checked against its reference once before it is timed. Kernels are timed as
CUDA-graph replays where they can be captured (see ``bench_graph``). Results: benchmarks/RESULTS.md.

    python benchmarks/bench_kernels.py            # the table (markdown; also $OUT/kernels.md)
    python benchmarks/bench_kernels.py --sweep    # first try decode/prefill/store launch configs
    python benchmarks/bench_kernels.py --smoke    # tiny shapes; runs on a CPU under the interpreter
    python benchmarks/bench_kernels.py --only decode,prefill --kv-dtypes auto,int8,fp8_e4m3,fp8_e5m2
                                                  # attention over 8-bit KV caches vs bf16 ('auto')

With ``--kv-dtypes``, each attention shape runs once per cache format; an 8-bit row counts the
bytes it really moves (1-byte codes + per-token-per-head scales) and notes its speed-up over the
bf16 Triton row of the same shape, its error vs the reference on the same codes, and ("quant")
how far quantizing moved the output from bf16 attention.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

if not torch.cuda.is_available():  # --smoke on a CPU machine: the interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minfer.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from minfer.kernels.attention.decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from minfer.kernels.attention.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from minfer.kernels.kv_store import store_kv, store_kv_ref  # noqa: E402
from minfer.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref  # noqa: E402
from minfer.kernels.attention.decode_attention import DecodeConfig, choose_num_splits  # noqa: E402
from minfer.kernels.gemm.gemv import gemv, gemv_rms_norm, gemv_silu_mul  # noqa: E402
from minfer.kernels.gemm.gemv_ref import gemv_ref  # noqa: E402
from minfer.kernels.gemm.gemv_config import RMS_NORM, SILU_MUL, GemvConfig  # noqa: E402
from minfer.kernels.gemm.gemv_config import default_config as default_gemv_config  # noqa: E402
from minfer.benchmark.bounds import HBM_BYTES_PER_S  # noqa: E402
from minfer.kernels.attention.prefill_attention import PrefillConfig  # noqa: E402
from minfer.kernels.attention import decode_attention_sm90 as sm90_decode  # noqa: E402
from minfer.kernels.attention import prefill_attention_sm90 as sm90_prefill  # noqa: E402
from minfer.kernels.attention.decode_attention_sm90 import paged_decode_attention_sm90  # noqa: E402
from minfer.kernels.attention.gluon_sm90 import sm90_available  # noqa: E402
from minfer.kernels.attention.prefill_attention_sm90 import paged_prefill_attention_sm90  # noqa: E402
from minfer.kernels.attention.kv_stage import plan_stage, stage_kv, staged_prefill_attention  # noqa: E402
from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS, KV_SCALE_DTYPE, quantize_ref  # noqa: E402

PEAK_BW = HBM_BYTES_PER_S  # BENCHMARKS.md's measured copy bandwidth
PEAK_FLOPS = 793e12
DT = torch.bfloat16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Row:
    kernel: str
    shape: str
    impl: str
    ms: float
    nbytes: float
    flops: float
    note: str = ""

    def md(self) -> str:
        bw = self.nbytes / (self.ms * 1e-3)
        fl = self.flops / (self.ms * 1e-3)
        return (f"| {self.kernel} | {self.shape} | {self.impl} | {self.ms * 1e3:.1f} | {bw / 1e12:.2f} | "
                f"{100 * bw / PEAK_BW:.0f}% | {fl / 1e12:.1f} | {100 * fl / PEAK_FLOPS:.1f}% | {self.note} |")


def bench(fn: Callable[[], object], rep: int = 200) -> float:
    """Median ms; on a machine without a GPU (``--smoke``) one host-timed call, only to exercise the script."""
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def bench_graph(fn: Callable[[], object], rep: int = 200) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` (how the engine runs decode steps).

    Short kernels (tens of microseconds) otherwise measure Python launch overhead: do_bench
    records its start event right after the L2 flush, and if the host is still inside the
    wrapper when the flush ends, that idle gap is timed. A graph replay is one cheap launch.
    """
    if DEV == "cpu":
        return bench(fn, rep)
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        print(f"  graph capture failed ({str(e)[:80]}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return bench(fn, rep)
    ms = do_bench(graph.replay, warmup=25, rep=rep, return_mode="median")
    del graph
    return ms


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> str:
    err = rel_err(out, ref)
    status = "ok" if err <= tol else "FAIL"
    print(f"  check {name}: rel err {err:.2e} {status}", flush=True)
    return f"err {err:.1e}" + ("" if status == "ok" else " FAIL")


# ----------------------------------------------------------------------------------------------- data
def paged_cache(ctx_lens: list[int], hkv: int, d: int, page: int) -> tuple[torch.Tensor, ...]:
    need = [math.ceil(c / page) for c in ctx_lens]
    nblocks = sum(need)
    perm = torch.randperm(nblocks, device=DEV).int()
    table = torch.zeros(len(ctx_lens), max(need), dtype=torch.int32, device=DEV)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(nblocks, page, hkv, d, device=DEV, dtype=DT)
    vc = torch.randn(nblocks, page, hkv, d, device=DEV, dtype=DT)
    return kc, vc, table, torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)


def quantized_cache(kc: torch.Tensor, vc: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, ...]:
    """(k codes, v codes, k_scale, v_scale) of bf16 caches in format ``kv_dtype`` (scales [blocks, Hkv, page])."""
    fmt = KV_QUANT_FORMATS[kv_dtype]
    kq, ks = quantize_ref(kc, fmt, KV_SCALE_DTYPE)
    vq, vs = quantize_ref(vc, fmt, KV_SCALE_DTYPE)
    return kq, vq, ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()


def kv_bytes(tokens: int, hkv: int, d: int, kv_dtype: str) -> int:
    """Bytes of K and V for ``tokens`` tokens: bf16, or 1-byte codes plus one scale per token and head."""
    per_head = 2 * d if kv_dtype == "auto" else d + KV_SCALE_DTYPE.itemsize
    return 2 * tokens * hkv * per_head


def contiguous_kv(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, ...]:
    """[B, Hkv, ctx, D] copies of the paged context, for SDPA (equal lengths only)."""
    page, hkv, d = kc.shape[1:]
    b = table.shape[0]
    k = kc[table.long()].reshape(b, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    v = vc[table.long()].reshape(b, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    return k, v


# --------------------------------------------------------------------------------------------- decode
DECODE_SWEEP = [DecodeConfig(bn, w, s) for bn, w, s in [(64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 3)]]
# 8-bit tiles are half the bytes: larger ones, with or without column sums (DecodeConfig.column_sums)
QUANT_DECODE_SWEEP = [DecodeConfig(bn, w, s, cs) for bn, w, s, cs in [
    (128, 4, 2, True), (128, 4, 3, True), (128, 4, 2, False), (64, 4, 2, False), (64, 4, 3, False),
    (128, 8, 2, True), (256, 8, 2, True)]]


def sweep_decode(run: Callable[[DecodeConfig, int], object], out: torch.Tensor, ref: torch.Tensor, shape: str,
                 impl: str, nbytes: float, flops: float, splits_opts: set[int],
                 configs: list[DecodeConfig] = DECODE_SWEEP) -> list[Row]:
    """Time ``run(config, num_splits)`` for every config and split count; print each, return the
    fastest accurate one as a row."""
    best = (float("inf"), None, None)
    for cfg in configs:
        for ns in sorted(splits_opts):
            try:
                fn = lambda: run(cfg, ns)
                fn()
                err = rel_err(out, ref)
                ms = bench_graph(fn, rep=50)
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                print(f"  sweep decode {impl} {cfg} splits={ns}: {type(e).__name__}", flush=True)
                continue
            print(f"  sweep decode {impl} {shape} {cfg} splits={ns}: {ms * 1e3:.1f} us "
                  f"{100 * nbytes / (ms * 1e-3) / PEAK_BW:.0f}% err {err:.1e}", flush=True)
            if err < 1e-2 and ms < best[0]:
                best = (ms, cfg, ns)
    print(f"  BEST decode {impl} {shape}: {best[1]} splits={best[2]} {best[0] * 1e3:.1f} us", flush=True)
    if best[1] is None:
        return []
    return [Row("decode attn", shape, f"{impl}, best of sweep", best[0], nbytes, flops, f"{best[1]} splits={best[2]}")]


def decode_case(batch: int, ctx: int, hq: int, hkv: int, d: int, label: str, sweep: bool,
                kv_dtype: str = "auto") -> list[Row]:
    page = 16
    kc, vc, table, lens = paged_cache([ctx] * batch, hkv, d, page)
    q = torch.randn(batch, hq, d, device=DEV, dtype=DT)
    scale = d ** -0.5
    nbytes = kv_bytes(batch * ctx, hkv, d, kv_dtype) + 2 * q.numel() * 2
    flops = 4 * batch * hq * ctx * d
    shape = f"{label} B={batch} ctx={ctx} Hq/Hkv={hq}/{hkv} D={d}"
    out = torch.empty_like(q)
    ref = paged_decode_attention_ref(q, kc, vc, table, lens, scale)
    default_splits = choose_num_splits(batch, hkv, table.shape[1] * page, q.device)
    if kv_dtype != "auto":
        return decode_quant_rows(q, kc, vc, table, lens, scale, out, ref, kv_dtype, shape, nbytes, flops,
                                 default_splits, sweep)
    rows: list[Row] = []
    if sweep:
        rows += sweep_decode(lambda cfg, ns: paged_decode_attention(q, kc, vc, table, lens, scale, out, num_splits=ns,
                                                                    config=cfg),
                             out, ref, shape, "triton", nbytes, flops,
                             {1, 2, default_splits} if batch * hkv >= 256 else {32, 64, 128, 256, default_splits})
    fn = lambda: paged_decode_attention(q, kc, vc, table, lens, scale, out)
    fn()
    note = check(f"decode {shape}", out, ref) + f", splits={default_splits}"
    rows.append(Row("decode attn", shape, "triton", bench_graph(fn), nbytes, flops, note))
    rows += sm90_rows("decode", shape, "", page, nbytes, flops, out, ref, None,
                      lambda: paged_decode_attention_sm90(q, kc, vc, table, lens, scale, out))
    rows.append(Row("decode attn", shape, "torch ref", bench_graph(lambda: paged_decode_attention_ref(
        q, kc, vc, table, lens, scale), rep=50), nbytes, flops, "gather + fp32 softmax"))
    try:
        k, v = contiguous_kv(kc, vc, table, ctx)
        q4 = q[:, :, None, :]
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        note = check("sdpa decode", sd()[:, :, 0], ref)
        rows.append(Row("decode attn", shape, "SDPA contiguous", bench_graph(sd), nbytes, flops, note + ", enable_gqa"))
        del k, v
    except Exception as e:
        print(f"  SDPA decode failed: {e}", flush=True)
    return rows


def decode_quant_rows(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                      scale: float, out: torch.Tensor, bf16_ref: torch.Tensor, kv_dtype: str, shape: str,
                      nbytes: float, flops: float, default_splits: int, sweep: bool) -> list[Row]:
    """The Triton decode over an 8-bit cache (the bf16 cache quantized), optionally after a config sweep."""
    kq, vq, ks, vs = quantized_cache(kc, vc, kv_dtype)
    del kc, vc
    sc = dict(k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_ref(q, kq, vq, table, lens, scale, **sc)
    rows: list[Row] = []
    if sweep:
        rows += sweep_decode(lambda cfg, ns: paged_decode_attention(q, kq, vq, table, lens, scale, out, num_splits=ns,
                                                                    config=cfg, **sc),
                             out, ref, shape, f"triton {kv_dtype}", nbytes, flops,
                             {1, 2, default_splits} if q.shape[0] * kq.shape[2] >= 256 else
                             {16, 32, 64, default_splits}, QUANT_DECODE_SWEEP)
    fn = lambda: paged_decode_attention(q, kq, vq, table, lens, scale, out, **sc)
    fn()
    note = check(f"decode {kv_dtype} {shape}", out, ref) + f", quant {rel_err(out, bf16_ref):.1e}"
    rows.append(Row("decode attn", shape, f"triton {kv_dtype}", bench_graph(fn), nbytes, flops,
                    note + f", splits={default_splits}"))
    rows += sm90_rows("decode", shape, f" {kv_dtype}", kq.shape[1], nbytes, flops, out, ref, bf16_ref,
                      lambda: paged_decode_attention_sm90(q, kq, vq, table, lens, scale, out, **sc))
    # The 64-token tile without column sums (the default before 128-token tiles), to keep that choice measured.
    alt = DecodeConfig(64, 4, 2)
    impl = f"triton {kv_dtype} 64-tiles"
    fn = lambda: paged_decode_attention(q, kq, vq, table, lens, scale, out, config=alt, **sc)
    fn()
    rows.append(Row("decode attn", shape, impl, bench_graph(fn), nbytes, flops, check(f"decode {impl}", out, ref)))
    return rows


# -------------------------------------------------------------------------------------------- prefill
PREFILL_SWEEP = [PrefillConfig(m, n, w, s) for m, n, w, s in [
    (128, 128, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 4, 2),
    (64, 64, 4, 3)]]


def sm90_rows(kernel: str, shape: str, fmt: str, page: int, nbytes: float, flops: float, out: torch.Tensor,
              ref: torch.Tensor, unquantized: torch.Tensor | None, fn: Callable[[], object]) -> list[Row]:
    """A Hopper kernel's row where it runs (``kernel``: "prefill" or "decode"; checked against ``ref``;
    ``unquantized``: the bf16 cache's reference, for the quantization error). Its entry point falls back to the
    Triton kernel if the build fails, so a row is written only when the Gluon kernel itself launched."""
    if not sm90_available(out.device, out.shape[-1], page):
        return []
    out.fill_(float("nan"))
    fn()
    guard = (sm90_prefill if kernel == "prefill" else sm90_decode)._guard
    if (unquantized is not None) in guard.failed:
        print(f"  {kernel} sm90{fmt}: the kernel did not build (warning above); no row", flush=True)
        return []
    note = check(f"{kernel} sm90{fmt}", out, ref)
    if unquantized is not None:
        note += f", quant {rel_err(out, unquantized):.1e}"
    return [Row(f"{kernel} attn", shape, f"gluon sm90 paged{fmt}", bench_graph(fn), nbytes, flops, note)]


def prefill_case(t: int, hq: int, hkv: int, d: int, sweep: bool, kv_dtype: str = "auto") -> list[Row]:
    page = 16
    kc, vc, table, lens = paged_cache([t], hkv, d, page)
    q = torch.randn(t, hq, d, device=DEV, dtype=DT)
    qsl = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    flops = 4 * t * t / 2 * d * hq
    nbytes = 2 * q.numel() * 2 + kv_bytes(t, hkv, d, kv_dtype)
    shape = f"T={t} causal Hq/Hkv={hq}/{hkv} D={d}"
    out = torch.empty_like(q)
    ref = paged_prefill_attention_ref(q, kc, vc, table, qsl, lens, t, scale)
    if kv_dtype != "auto":
        kq, vq, ks, vs = quantized_cache(kc, vc, kv_dtype)
        sc = dict(k_scale=ks, v_scale=vs)
        qref = paged_prefill_attention_ref(q, kq, vq, table, qsl, lens, t, scale, **sc)
        fn = lambda: paged_prefill_attention(q, kq, vq, table, qsl, lens, t, scale, out, **sc)
        fn()
        note = check(f"prefill {kv_dtype}", out, qref) + f", quant {rel_err(out, ref):.1e}"
        rows = [Row("prefill attn", shape, f"triton paged {kv_dtype}", bench_graph(fn), nbytes, flops, note)]
        rows += sm90_rows("prefill", shape, f" {kv_dtype}", page, nbytes, flops, out, qref, ref,
                                  lambda: paged_prefill_attention_sm90(q, kq, vq, table, qsl, lens, t, scale, out, **sc))
        # Staged (kv_stage.py, the engine's default on Hopper): the pages dequantized once, then the 16-bit kernel.
        plan = plan_stage(lens.tolist(), [t], page, table.shape[1], 0, q.device)
        stage_bytes = kv_bytes(t, hkv, d, kv_dtype) + kv_bytes(t, hkv, d, "auto")
        rows.append(Row("stage kv", f"T={t} Hkv={hkv} D={d}", f"triton {kv_dtype} -> bf16",
                        bench_graph(lambda: stage_kv(kq, vq, ks, vs, table, plan, q.dtype)), stage_bytes, 0.0))
        rows += sm90_rows("prefill", shape, f" {kv_dtype} staged", page, nbytes, flops, out, qref, None,
                          lambda: staged_prefill_attention(paged_prefill_attention_sm90, q, kq, vq, table, qsl, lens,
                                                           t, scale, out, plan=plan, **sc))
        return rows
    rows: list[Row] = []
    if sweep:
        best = (float("inf"), None)
        for cfg in PREFILL_SWEEP:
            try:
                fn = lambda: paged_prefill_attention(q, kc, vc, table, qsl, lens, t, scale, out, config=cfg)
                fn()
                err = rel_err(out, ref)
                ms = bench(fn, rep=50)
            except Exception as e:
                print(f"  sweep prefill {cfg}: {type(e).__name__}", flush=True)
                continue
            print(f"  sweep prefill {cfg}: {ms * 1e3:.0f} us {flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s err {err:.1e}",
                  flush=True)
            if err < 1e-2 and ms < best[0]:
                best = (ms, cfg)
        print(f"  BEST prefill: {best[1]} {best[0] * 1e3:.0f} us", flush=True)
        if best[1] is not None:
            rows.append(Row("prefill attn", shape, "triton paged, best of sweep", best[0], nbytes, flops, str(best[1])))
    fn = lambda: paged_prefill_attention(q, kc, vc, table, qsl, lens, t, scale, out)
    fn()
    note = check("prefill", out, ref)
    rows.append(Row("prefill attn", shape, "triton paged", bench_graph(fn), nbytes, flops, note))
    rows += sm90_rows("prefill", shape, "", page, nbytes, flops, out, ref, None,
                              lambda: paged_prefill_attention_sm90(q, kc, vc, table, qsl, lens, t, scale, out))
    rows.append(Row("prefill attn", shape, "torch ref", bench(lambda: paged_prefill_attention_ref(
        q, kc, vc, table, qsl, lens, t, scale), rep=50), nbytes, flops, "gather + fp32 softmax, eager"))
    k, v = contiguous_kv(kc, vc, table, t)
    q4 = q.transpose(0, 1)[None]
    for gqa in (True, False):
        try:
            kk = k if gqa else k.repeat_interleave(hq // hkv, dim=1)
            vv = v if gqa else v.repeat_interleave(hq // hkv, dim=1)
            sd = lambda: torch.nn.functional.scaled_dot_product_attention(
                q4, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
            note = check(f"sdpa prefill gqa={gqa}", sd()[0].transpose(0, 1), ref)
            impl = "SDPA contiguous" + (" enable_gqa" if gqa else " K/V repeated")
            rows.append(Row("prefill attn", shape, impl, bench_graph(sd), nbytes, flops, note))
        except Exception as e:
            print(f"  SDPA prefill gqa={gqa} failed: {e}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------- elementwise
def rms_case(t: int, h: int) -> list[Row]:
    x = torch.randn(t, h, device=DEV, dtype=DT)
    res = torch.randn(t, h, device=DEV, dtype=DT)
    w = torch.randn(h, device=DEV, dtype=DT)
    nbytes = 4 * t * h * 2 + h * 2  # read x, residual; write residual, out; read weight
    shape = f"{t}x{h}"
    r1, r2 = res.clone(), res.clone()
    note = check("add+rmsnorm", fused_add_rms_norm(x, r1, w, 1e-6), fused_add_rms_norm_ref(x, r2, w, 1e-6))
    return [Row("add+rmsnorm", shape, "triton", bench_graph(lambda: fused_add_rms_norm(x, res, w, 1e-6)), nbytes, 0,
                note),
            Row("add+rmsnorm", shape, "torch ref", bench_graph(lambda: fused_add_rms_norm_ref(x, res, w, 1e-6)),
                nbytes, 0)]


def silu_case(t: int, inter: int) -> list[Row]:
    x = torch.randn(t, 2 * inter, device=DEV, dtype=DT)
    nbytes = 3 * t * inter * 2
    shape = f"{t}x{inter}"
    note = check("silu_and_mul", silu_and_mul(x), silu_and_mul_ref(x))
    return [Row("silu_and_mul", shape, "triton", bench_graph(lambda: silu_and_mul(x)), nbytes, 0, note),
            Row("silu_and_mul", shape, "torch ref", bench_graph(lambda: silu_and_mul_ref(x)), nbytes, 0)]


def store_case(t: int, hkv: int, d: int, sweep: bool, kv_dtype: str = "auto") -> list[Row]:
    page = 16
    nblocks = t // page * 2
    fmt = KV_QUANT_FORMATS.get(kv_dtype)
    kc = torch.empty(nblocks, page, hkv, d, device=DEV, dtype=DT if fmt is None else fmt.dtype)
    vc = torch.empty_like(kc)
    sc = {} if fmt is None else dict(k_scale=torch.empty(nblocks, hkv, page, device=DEV, dtype=KV_SCALE_DTYPE),
                                     v_scale=torch.empty(nblocks, hkv, page, device=DEV, dtype=KV_SCALE_DTYPE))
    kv = torch.randn(t, 2 * hkv * d, device=DEV, dtype=DT)
    k, v = kv[:, :hkv * d].view(t, hkv, d), kv[:, hkv * d:].view(t, hkv, d)
    slots = torch.randperm(nblocks * page, device=DEV)[:t]
    nbytes = 2 * t * hkv * d * 2 + kv_bytes(t, hkv, d, kv_dtype)
    shape = f"T={t} Hkv={hkv} D={d} page={page}"
    kr, vr = kc.clone(), vc.clone()
    scr = {name: x.clone() for name, x in sc.items()}
    store_kv(k, v, kc, vc, slots, **sc)
    store_kv_ref(k, v, kr, vr, slots, **scr)
    same = torch.equal(kc.view(-1, hkv, d)[slots].view(torch.uint8 if fmt else DT),
                       kr.view(-1, hkv, d)[slots].view(torch.uint8 if fmt else DT))
    note = "exact" if same else "MISMATCH"
    impl = "triton" if fmt is None else f"triton {kv_dtype}"
    if sweep:
        for nw in (1, 2, 4, 8):
            ms = bench_graph(lambda: store_kv(k, v, kc, vc, slots, num_warps=nw, **sc), rep=50)
            print(f"  sweep store_kv {kv_dtype} warps={nw}: {ms * 1e3:.1f} us "
                  f"{100 * nbytes / (ms * 1e-3) / PEAK_BW:.0f}%")
    rows = [Row("store_kv", shape, impl, bench_graph(lambda: store_kv(k, v, kc, vc, slots, **sc)), nbytes, 0, note)]
    if fmt is None:
        rows.append(Row("store_kv", shape, "torch ref", bench(lambda: store_kv_ref(k, v, kc, vc, slots)), nbytes, 0,
                        "eager (host sync)"))
    return rows


GEMV_SWEEP = [GemvConfig(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)]


def gemv_case(n: int, k: int, label: str, sweep: bool) -> list[Row]:
    """Batch-1 linear layer: the Triton matrix-vector kernel against torch's linear (cuBLAS)."""
    x = torch.randn(1, k, device=DEV, dtype=DT)
    w = torch.randn(n, k, device=DEV, dtype=DT) / k ** 0.5
    nbytes, flops = 2 * (n * k + n + k), 2 * n * k
    shape = f"{label} {n}x{k}, x [1, {k}]"
    note = check(f"gemv {shape}", gemv(x, w), gemv_ref(x, w))
    rows = [Row("gemv", shape, "triton", bench_graph(lambda: gemv(x, w)), nbytes, flops,
                f"{note}, {default_gemv_config(n, k)}"),
            Row("gemv", shape, "torch linear", bench_graph(lambda: torch.nn.functional.linear(x, w)), nbytes, flops)]
    if sweep:
        best = min(((bench_graph(lambda: gemv(x, w, config=c), rep=50), c) for c in GEMV_SWEEP), key=lambda t: t[0])
        print(f"  BEST gemv {shape}: {best[1]} {best[0] * 1e3:.1f} us", flush=True)
        rows.append(Row("gemv", shape, "triton, best of sweep", best[0], nbytes, flops, str(best[1])))
    return rows


def gemv_fused_case(n: int, k: int, label: str, prologue: str, sweep: bool) -> list[Row]:
    """Batch-1 linear layer with its input op fused in (``prologue`` "silu": SwiGLU of [1, 2K] gate|up before the
    down projection; "add_rms": residual add + RMSNorm before qkv / gate_up) against the two launches it replaces,
    which are also what it is checked against (the same roundings; the references round differently under the
    interpreter, which truncates to bfloat16).

    Both rows count the same bytes (weight, the vector inputs once, y and the new residual once), so their
    bandwidth columns compare directly; the saving is the second launch and the [1, K] round trip."""
    eps = 1e-5
    w = torch.randn(n, k, device=DEV, dtype=DT) / k ** 0.5
    if prologue == "silu":
        xgu = torch.randn(1, 2 * k, device=DEV, dtype=DT)
        nbytes = 2 * (n * k + n + 2 * k)
        fused = lambda cfg=None: gemv_silu_mul(xgu, w, cfg)
        unfused = lambda: gemv(silu_and_mul(xgu), w)
        kernel, unfused_impl = "gemv+silu", "silu_and_mul then gemv"
        note = check(f"gemv+silu {n}x{k}", fused(), unfused())
    else:
        x = torch.randn(1, k, device=DEV, dtype=DT)
        res = torch.randn(1, k, device=DEV, dtype=DT)
        nw = torch.randn(k, device=DEV, dtype=DT)
        nbytes = 2 * (n * k + n + 4 * k)  # read x, residual, norm weight; write the new residual
        fused = lambda cfg=None: gemv_rms_norm(x, res, nw, eps, w, config=cfg)
        unfused = lambda: gemv(fused_add_rms_norm(x, res, nw, eps), w)  # res grows each replay, as in rms_case
        kernel, unfused_impl = "gemv+add_rms", "fused_add_rms_norm then gemv"
        y, new_res = fused()
        res_check = res.clone()
        note = check(f"gemv+add_rms {n}x{k}", y, gemv(fused_add_rms_norm(x, res_check, nw, eps), w))
        note += "" if torch.equal(new_res, res_check) else " residual MISMATCH"
    shape = f"{label} {n}x{k}, x [1, {k}]"
    fused_ms, unfused_ms = bench_graph(fused), bench_graph(unfused)
    cfg = default_gemv_config(n, k, SILU_MUL if prologue == "silu" else RMS_NORM)
    rows = [Row(kernel, shape, "triton fused", fused_ms, nbytes, 2 * n * k,
                f"{note}, {unfused_ms / fused_ms:.2f}x unfused, {cfg}"),
            Row(kernel, shape, unfused_impl, unfused_ms, nbytes, 2 * n * k, "two launches")]
    if sweep:
        best = min(((bench_graph(lambda c=c: fused(c), rep=50), c) for c in GEMV_SWEEP), key=lambda t: t[0])
        print(f"  BEST {kernel} {shape}: {best[1]} {best[0] * 1e3:.1f} us", flush=True)
        rows.append(Row(kernel, shape, "triton fused, best of sweep", best[0], nbytes, 2 * n * k, str(best[1])))
    return rows


def add_speedups(rows: list[Row]) -> None:
    """Note each 8-bit row's speed-up over the bf16 row of the same kernel (Triton or Gluon) and shape, and
    over the faster of our bf16 kernels where that is the other one (what the 8-bit targets compare with)."""
    def family(impl: str) -> str:  # the bf16 row an 8-bit row compares with: the same kernel's
        return next((b for b in ("gluon sm90 paged", "triton paged") if impl.startswith(b)), "triton")

    bf16_impls = ("triton", "triton paged", "gluon sm90 paged")
    base = {(r.kernel, r.shape, r.impl): r.ms for r in rows if r.impl in bf16_impls}
    for r in rows:
        quant = any(w.rstrip(",") in KV_QUANT_FORMATS for w in r.impl.split())
        key = (r.kernel, r.shape, family(r.impl))
        if quant and "sweep" not in r.impl and key in base:
            r.note += f", {base[key] / r.ms:.2f}x bf16"
            best = min(ms for (k, sh, _), ms in base.items() if (k, sh) == key[:2])
            if best < base[key]:
                r.note += f", {best / r.ms:.2f}x fastest bf16"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="try launch configs first and print the best")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to test the script itself (CPU ok)")
    ap.add_argument("--only", default="", help="comma list: decode,prefill,rms,silu,store,gemv")
    ap.add_argument("--kv-dtypes", default="auto",
                    help="comma list of KV cache formats for decode/prefill: auto (bf16), int8, fp8_e4m3, fp8_e5m2")
    args = ap.parse_args()
    kv_dtypes = args.kv_dtypes.split(",")
    for kd in kv_dtypes:
        if kd != "auto" and kd not in KV_QUANT_FORMATS:
            ap.error(f"--kv-dtypes: unknown format {kd!r}; allowed: auto, {', '.join(KV_QUANT_FORMATS)}")
    only = set(filter(None, args.only.split(",")))
    want = lambda name: not only or name in only
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke run)"
    print(f"# {name} torch {torch.__version__} triton {triton.__version__}", flush=True)
    rows: list[Row] = []
    sw = args.sweep
    if args.smoke:
        global DECODE_SWEEP, PREFILL_SWEEP
        DECODE_SWEEP, PREFILL_SWEEP = DECODE_SWEEP[:1], [PrefillConfig(32, 32, 4, 1)]
        attention = [("decode", lambda kd: decode_case(2, 64, 4, 2, 32, "tiny", sw, kd)),
                     ("decode", lambda kd: decode_case(1, 300, 4, 2, 32, "tiny", sw, kd)),
                     ("prefill", lambda kd: prefill_case(40, 4, 2, 32, sw, kd)),
                     ("store", lambda kd: store_case(32, 2, 32, sw, kd))]
        others: list[tuple[str, Callable[[], list[Row]]]] = [
            ("rms", lambda: rms_case(8, 256)),
            ("silu", lambda: silu_case(8, 256)),
            ("gemv", lambda: gemv_case(40, 96, "tiny", sw)),
            ("gemv", lambda: gemv_fused_case(40, 96, "tiny", "add_rms", sw)),
            ("gemv", lambda: gemv_fused_case(40, 96, "tiny", "silu", sw)),
        ]
    else:
        attention = [
            ("decode", lambda kd: decode_case(64, 4096, 16, 8, 128, "qwen3-0.6b", sw, kd)),
            ("decode", lambda kd: decode_case(64, 4096, 32, 8, 128, "llama-3.1-8b", False, kd)),
            ("decode", lambda kd: decode_case(1, 32768, 32, 8, 128, "llama-3.1-8b", sw, kd)),
            ("decode", lambda kd: decode_case(1, 32768, 16, 8, 128, "qwen3-0.6b", False, kd)),
            ("prefill", lambda kd: prefill_case(8192, 32, 8, 128, sw, kd)),
            ("store", lambda kd: store_case(8192, 8, 128, sw, kd)),
        ]
        others = [
            ("rms", lambda: rms_case(8192, 4096)),
            ("silu", lambda: silu_case(8192, 14336)),
            *[("gemv", lambda n=n, k=k, lb=lb: gemv_case(n, k, lb, sw)) for n, k, lb in [
                (3072, 2048, "1b qkv"), (2048, 2048, "1b o"), (16384, 2048, "1b gate_up"), (2048, 8192, "1b down"),
                (4096, 1024, "0.6b qkv"), (1024, 2048, "0.6b o"), (6144, 1024, "0.6b gate_up"),
                (1024, 3072, "0.6b down")]],
            # the same layers with the op before them fused in, next to the two launches they replace
            *[("gemv", lambda n=n, k=k, lb=lb, p=p: gemv_fused_case(n, k, lb, p, sw)) for n, k, lb, p in [
                (3072, 2048, "1b qkv", "add_rms"), (16384, 2048, "1b gate_up", "add_rms"),
                (2048, 8192, "1b down", "silu")]],
        ]
    # Each KV-cache shape once per format, formats adjacent so the rows compare at a glance.
    steps = [(name, (lambda f=f, kd=kd: f(kd))) for name, f in attention for kd in kv_dtypes] + others
    for name, step in steps:
        if want(name):
            print(f"== {name}", flush=True)
            rows += step()
            torch.cuda.empty_cache()
    add_speedups(rows)
    header = ("| kernel | shape | impl | time (us) | TB/s | % of 4.22 TB/s | TFLOP/s | % of 793 TFLOP/s | note |\n"
              "|---|---|---|---|---|---|---|---|---|")
    table = "\n".join([header] + [r.md() for r in rows])
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kernels.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
