"""The Hopper (Gluon) paged decode kernel against the float64 reference and the Triton kernel it stands in for,
on an sm_90 GPU (`pytest -m gpu`): page sizes, GQA ratios (1 to 16 heads per KV head), head dims, 16-bit
dtypes, every 8-bit cache format, split counts with empty splits, contexts that are not multiples of the
64-key tile, a strided q and CUDA-graph replay; sliding windows (with split-K, 8-bit caches, and the table
entries of blocks wholly before each window stale), logit soft-capping and attention sinks (gpt-oss)."""

import pytest
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    check_decode, check_decode_quant, check_decode_window, make_paged_kv, quantize_paged_kv, rel_err,
    seed_per_case,
)
from minfer.kernels.attention import decode_attention_sm90 as sm90
from minfer.kernels.attention.decode_attention import paged_decode_attention
from minfer.kernels.attention.decode_attention_sm90 import paged_decode_attention_sm90
from minfer.kernels.attention.gluon_sm90 import sm90_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sm90_available(torch.device("cuda"), 128, 16),
                       reason="needs an sm_90 GPU and Triton's Gluon"),
]


@pytest.fixture(autouse=True)
def the_hopper_kernel_ran():
    """The entry point falls back to the Triton kernel if the Gluon kernel fails to build: a test that passed
    that way tested the wrong kernel."""
    yield
    assert not sm90._guard.failed, "the Hopper kernel did not build (see the warning): the Triton kernel ran instead"


# One key, a page less one, a page, a page and one, a tile and one, a long context.
CTX_LENS = [1, 15, 16, 17, 65, 1000, 4096]
SHAPES = [(16, 8, 128), (32, 8, 128), (32, 8, 64), (8, 8, 128), (64, 4, 128), (24, 4, 128)]
SHAPE_IDS = ["qwen3-0.6b", "llama-3.1-8b", "llama-3.2-1b", "mha", "gqa16", "gqa6"]


@pytest.mark.parametrize("splits", [None, 1, 5, 64], ids=["heuristic", "1", "5", "64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_sm90(shape: tuple[int, int, int], dtype: torch.dtype, splits: int | None) -> None:
    check_decode(CTX_LENS, *shape, 16, dtype, "cuda", num_splits=splits, kernel=paged_decode_attention_sm90)


@pytest.mark.parametrize("page", [32, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [1, 7])
def test_decode_sm90_pages(page: int, head_dim: int, splits: int) -> None:
    check_decode(CTX_LENS, 16, 4, head_dim, page, torch.bfloat16, "cuda", num_splits=splits,
                 kernel=paged_decode_attention_sm90)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape,page", [((32, 8, 128), 16), ((16, 8, 128), 64), ((32, 8, 64), 16),
                                        ((8, 8, 128), 256), ((64, 4, 128), 32)],
                         ids=["8b-p16", "0.6b-p64", "1b-p16", "mha-p256", "gqa16-p32"])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_sm90_quant(kv_dtype: str, shape: tuple[int, int, int], page: int, splits: int) -> None:
    check_decode_quant(CTX_LENS, *shape, page, kv_dtype, torch.bfloat16, "cuda", num_splits=splits,
                       kernel=paged_decode_attention_sm90)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_sm90_quant_fp16_q(kv_dtype: str) -> None:
    """A float16 q goes to the products as it is (a bf16 q is converted first)."""
    check_decode_quant(CTX_LENS, 32, 8, 128, 16, kv_dtype, torch.float16, "cuda", kernel=paged_decode_attention_sm90)


@pytest.mark.parametrize("kv_dtype,page", [("int8", 16), ("fp8_e4m3", 64), ("fp8_e5m2", 32)])
def test_decode_sm90_quant_fp32_scales(kv_dtype: str, page: int) -> None:
    """float32 scales (the engine keeps float16 ones): the copy warp's scale boxes are twice as wide."""
    check_decode_quant(CTX_LENS, 32, 8, 128, page, kv_dtype, torch.bfloat16, "cuda", num_splits=3,
                       kernel=paged_decode_attention_sm90, scale_dtype=torch.float32)


def caches(ctx_lens: list[int], kv_dtype: str) -> tuple:
    """(k cache, v cache, block table, scale keywords): bf16 caches for "auto", else 8-bit codes and scales."""
    kf, vf, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.float32, "cuda")
    if kv_dtype == "auto":
        return kf.bfloat16(), vf.bfloat16(), table, {}
    kc, vc, ks, vs = quantize_paged_kv(kf, vf, kv_dtype)
    return kc, vc, table, dict(k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_decode_sm90_matches_triton(kv_dtype: str) -> None:
    """Both kernels round P to the products' dtype and accumulate in float32 (8-bit: float16 products on exactly
    converted codes, the same per-key scales): they agree far inside the tolerance against float64."""
    ctx_lens = [4096, 3000, 77, 1]
    kc, vc, table, sc = caches(ctx_lens, kv_dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(ctx_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    for splits in (1, 16):
        args = (q, kc, vc, table, lens, 128 ** -0.5)
        fast = paged_decode_attention_sm90(*args, num_splits=splits, **sc)
        ref = paged_decode_attention(*args, num_splits=splits, **sc)
        assert rel_err(fast, ref) < 4e-3, (splits, rel_err(fast, ref))


@pytest.mark.parametrize("how", [{}, dict(window=300, softcap=30.0)], ids=["plain", "window300-cap30"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_decode_sm90_strided_q_and_graph(kv_dtype: str, how: dict) -> None:
    """q as a slice of a fused qkv projection (row stride > Hq*D), the split kernel and the merge inside a CUDA
    graph, replayed after the contexts grew: how the engine's decode graphs run it (a window's start moves with
    the context on the device)."""
    ctx_lens = [700, 45, 3000]
    kc, vc, table, sc = caches([c + 100 for c in ctx_lens], kv_dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    qkv = torch.randn(len(ctx_lens), (32 + 16) * 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :32 * 128].view(-1, 32, 128)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    args = (q, kc, vc, table, lens, 128 ** -0.5)
    paged_decode_attention_sm90(*args, out=out, num_splits=4, **sc, **how)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention_sm90(*args, out=out, num_splits=4, **sc, **how)
    for grow in (0, 100):
        lens.add_(grow)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_decode_attention(q.contiguous(), *args[1:], num_splits=4, **sc, **how)
        assert rel_err(out, ref) < 4e-3, (grow, rel_err(out, ref))


# ------------------------------------------------------------------ sliding windows and logit soft-capping
# Contexts shorter than the windows below, equal to one (21, 37), one past it, past a 64-key tile, and long.
WINDOW_CTX_LENS = [1, 15, 16, 17, 21, 22, 37, 38, 65, 1000, 4096]


def check_window(*args, stale: int | str | None = None, **kwargs) -> torch.Tensor:
    """``check_decode_window`` on the Hopper kernel, with a failure that names a stale read: ``stale="nan"``
    points every table entry of a block wholly before the window at a block of NaN, so a kernel that looks one
    up (the hybrid cache will have freed those blocks) turns the output into NaN through P·V, even where the
    key is masked (0 · NaN); ``stale=-1`` checks the kernel neither faults on nor needs those entries."""
    try:
        return check_decode_window(*args, stale=stale, kernel=paged_decode_attention_sm90, **kwargs)
    except AssertionError as exc:
        if stale == "nan" and "non-finite" in str(exc):
            raise AssertionError(
                f"NaN output with the entries before each window pointing at a NaN block ({kwargs}): the kernel "
                "read a block-table entry wholly outside the window (if the stale=-1 case of the same window "
                "passes, that is the only explanation; if it fails too, the NaN comes from the softmax)") from exc
        raise


@pytest.mark.parametrize("stale", [-1, "nan"], ids=["minus1", "nan-block"])
@pytest.mark.parametrize("splits", [None, 1, 5, 64], ids=["heuristic", "1", "5", "64"])
@pytest.mark.parametrize("window", [5, 21, 37])
def test_decode_sm90_window(window: int, splits: int | None, stale: int | str) -> None:
    """Windows cutting 16-token pages in the middle, with split-K (64 splits of a 5-key window: most empty); the
    splits cover [ctx - window, ctx) from the copy holding its first key, never a page before it."""
    check_window(WINDOW_CTX_LENS, 32, 8, 128, 16, torch.bfloat16, "cuda", window=window, num_splits=splits,
                 stale=stale)


@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [37, 200])
def test_decode_sm90_window_pages(page: int, head_dim: int, window: int) -> None:
    """Pages past the 64-key tile: a window starts inside a page, at the 64-key copy that holds its first key."""
    check_window([1, 100, 257, 1000, 3001], 16, 4, head_dim, page, torch.bfloat16, "cuda", window=window,
                 num_splits=3, stale="nan")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_sm90_window_shapes(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    check_window(WINDOW_CTX_LENS, *shape, 16, dtype, "cuda", window=21, num_splits=5, stale=-1)


@pytest.mark.parametrize("window", [0, 37, 1000], ids=["no-window", "window37", "window1000"])
@pytest.mark.parametrize("softcap", [50.0, 5.0])
@pytest.mark.parametrize("splits", [1, 7])
def test_decode_sm90_softcap(softcap: float, window: int, splits: int) -> None:
    """Soft-capping alone and with a window. q scaled 10x puts the scaled scores at a spread of ~10: a cap of
    50 bends them, one of 5 saturates most (the cap must be applied to the natural score before log2 e)."""
    check_window(WINDOW_CTX_LENS, 32, 8, 128, 16, torch.bfloat16, "cuda", window=window, softcap=softcap,
                 num_splits=splits, q_gain=10.0, stale="nan" if window else None)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page,window,softcap", [(16, 21, 0.0), (16, 37, 50.0), (64, 37, 0.0), (256, 200, 30.0)],
                         ids=["p16-w21", "p16-w37-cap50", "p64-w37", "p256-w200-cap30"])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_sm90_quant_window(kv_dtype: str, page: int, window: int, softcap: float, splits: int) -> None:
    """8-bit caches: the copy warp's code and scale copies start at the window too (a scale read before it would
    be NaN here)."""
    check_window(WINDOW_CTX_LENS, 32, 8, 128, page, torch.bfloat16, "cuda", window=window, softcap=softcap,
                 num_splits=splits, kv_dtype=kv_dtype, q_gain=4.0 if softcap else 1.0, stale="nan")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_decode_sm90_window_matches_triton(kv_dtype: str) -> None:
    """Against the Triton kernel with a window and a cap: both round P alike and accumulate in float32, so they
    agree far inside the tolerance against float64 (a systematic error in either shows here)."""
    ctx_lens = [4096, 3000, 77, 1]
    kc, vc, table, sc = caches(ctx_lens, kv_dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = 4 * torch.randn(len(ctx_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    for splits in (1, 16):
        args = (q, kc, vc, table, lens, 128 ** -0.5)
        fast = paged_decode_attention_sm90(*args, num_splits=splits, window=1000, softcap=30.0, **sc)
        ref = paged_decode_attention(*args, num_splits=splits, window=1000, softcap=30.0, **sc)
        assert rel_err(fast, ref) < 4e-3, (splits, rel_err(fast, ref))


# ------------------------------------------------------------------ attention sinks (gpt-oss)
GPT_OSS = (64, 8, 64)  # gpt-oss's heads: 64 query heads (8 per KV head) of 64 dims


def sinks_like(num_heads: int, value: float | None = None) -> torch.Tensor:
    """bf16 sinks (the model dtype) of both signs about the scores' spread, or all ``value``."""
    if value is not None:
        return torch.full((num_heads,), value, device="cuda", dtype=torch.bfloat16)
    return (2 * torch.randn(num_heads, device="cuda")).bfloat16()


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"], ids=["bf16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize("splits", [None, 1, 7, 64], ids=["heuristic", "1", "7", "64"])
def test_decode_sm90_sinks(kv_dtype: str | None, window: int, splits: int | None) -> None:
    """Sinks (split 0 alone counts them; 64 splits leave empty ones), alone and with gpt-oss's 128-key window, over
    16- and 8-bit caches, against the float64 reference."""
    check_window(WINDOW_CTX_LENS, *GPT_OSS, 16, torch.bfloat16, "cuda", window=window, num_splits=splits,
                 kv_dtype=kv_dtype, sinks=sinks_like(64), stale="nan" if window else None)


@pytest.mark.parametrize("value", [30.0, float("-inf")], ids=["plus30", "minus-inf"])
@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=["bf16", "int8"])
def test_decode_sm90_sink_extremes(value: float, kv_dtype: str | None) -> None:
    """A sink of +30 outweighs every score (the output shrinks, still exact: its weight is e^30 against the window's
    sum of e^score, which for some rows of the int8 cache passes e^8); a -inf sink is no sink."""
    for splits in (1, 5):
        torch.manual_seed(11)
        got = check_window(WINDOW_CTX_LENS, *GPT_OSS, 16, torch.bfloat16, "cuda", window=128, num_splits=splits,
                           kv_dtype=kv_dtype, sinks=sinks_like(64, value))
        torch.manual_seed(11)
        plain = check_window(WINDOW_CTX_LENS, *GPT_OSS, 16, torch.bfloat16, "cuda", window=128, num_splits=splits,
                             kv_dtype=kv_dtype)
        if value > 0:
            assert got.float().norm() < 0.5 * plain.float().norm()
        else:
            assert rel_err(got, plain) < 1e-3, rel_err(got, plain)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_decode_sm90_sinks_match_triton(kv_dtype: str) -> None:
    """Against the Triton kernel with sinks, with and without a window, split and not: both count each sink once and
    round P alike, so they agree far inside the tolerance against float64."""
    ctx_lens = [4096, 3000, 77, 1]
    kc, vc, table, sc = caches(ctx_lens, kv_dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(ctx_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    sinks = sinks_like(32)
    for splits in (1, 16):
        for window in (0, 128):
            args = (q, kc, vc, table, lens, 128 ** -0.5)
            fast = paged_decode_attention_sm90(*args, num_splits=splits, window=window, sinks=sinks, **sc)
            ref = paged_decode_attention(*args, num_splits=splits, window=window, sinks=sinks, **sc)
            assert rel_err(fast, ref) < 4e-3, (splits, window, rel_err(fast, ref))
