"""The Hopper (Gluon) paged prefill kernel against the float64 reference and the Triton kernel it
stands in for, on an sm_90 GPU (`pytest -m gpu`): page sizes, GQA ratios, head dims, 16-bit dtypes,
every 8-bit cache format, chunks that start mid-sequence and lengths that are not multiples of the
128-row tiles; sliding windows (chunked prefill mid-sequence, 8-bit caches, the table entries of blocks
wholly before each chunk's first window stale), logit soft-capping and attention sinks (gpt-oss)."""

import pytest
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    check_prefill, check_prefill_quant, check_prefill_window, make_paged_kv, quantize_paged_kv, rel_err,
    seed_per_case,
)
from minfer.kernels.attention import prefill_attention_sm90 as sm90
from minfer.kernels.attention.prefill_attention import paged_prefill_attention
from minfer.kernels.attention.gluon_sm90 import sm90_available
from minfer.kernels.attention.prefill_attention_sm90 import paged_prefill_attention_sm90

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


def batch(q_lens: list[int], ctx_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_start_loc, context_lens) of a varlen prefill batch, on the GPU."""
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().cuda()
    return qsl, torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")


# A whole prompt, a chunk starting mid-sequence, a single-row chunk, a short prompt, an overhanging tile.
Q_LENS = [1000, 300, 1, 77, 129]
CTX_LENS = [1000, 2000, 513, 77, 4000]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(16, 8, 128), (32, 8, 128), (32, 8, 64), (8, 8, 128), (32, 4, 128)],
                         ids=["qwen3-0.6b", "llama-3.1-8b", "llama-3.2-1b", "mha", "gqa8"])
def test_prefill_sm90(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    check_prefill(Q_LENS, CTX_LENS, *shape, 16, dtype, "cuda", kernel=paged_prefill_attention_sm90)


@pytest.mark.parametrize("page", [32, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_sm90_pages(page: int, head_dim: int) -> None:
    check_prefill(Q_LENS, CTX_LENS, 16, 4, head_dim, page, torch.bfloat16, "cuda", kernel=paged_prefill_attention_sm90)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape,page", [((32, 8, 128), 16), ((16, 8, 128), 64), ((32, 8, 64), 16), ((8, 8, 128), 256)],
                         ids=["8b-p16", "0.6b-p64", "1b-p16", "mha-p256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_sm90_quant(kv_dtype: str, shape: tuple[int, int, int], page: int, dtype: torch.dtype) -> None:
    check_prefill_quant(Q_LENS, CTX_LENS, *shape, page, kv_dtype, dtype, "cuda", kernel=paged_prefill_attention_sm90)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_prefill_sm90_quant_matches_triton(kv_dtype: str) -> None:
    """Over 8-bit caches both kernels take float16 products on exactly converted codes and scale the same
    columns: they agree to float16 rounding."""
    q_lens, ctx_lens = [4096, 1000], [4096, 3000]
    kf, vf, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.float32, "cuda")
    kc, vc, ks, vs = quantize_paged_kv(kf, vf, kv_dtype)
    qsl, lens = batch(q_lens, ctx_lens)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, kc, vc, table, qsl, lens, max(q_lens), 128 ** -0.5)
    fast = paged_prefill_attention_sm90(*args, k_scale=ks, v_scale=vs)
    ref = paged_prefill_attention(*args, k_scale=ks, v_scale=vs)
    assert rel_err(fast, ref) < 4e-3


def test_prefill_sm90_matches_triton() -> None:
    """Both kernels round P to bf16 before P·V and accumulate in float32: they agree far inside the
    bf16 tolerance, so a systematic error in either shows here."""
    q_lens, ctx_lens = [8192, 2048, 1024], [8192, 6144, 1024]
    k_cache, v_cache, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.bfloat16, "cuda")
    qsl, lens = batch(q_lens, ctx_lens)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, k_cache, v_cache, table, qsl, lens, max(q_lens), 128 ** -0.5)
    fast, ref = paged_prefill_attention_sm90(*args), paged_prefill_attention(*args)
    assert rel_err(fast, ref) < 4e-3


def test_prefill_sm90_strided_q_and_graph() -> None:
    """q as a slice of a fused qkv projection (row stride > Hq*D), launched inside a CUDA graph."""
    q_lens, ctx_lens = [300, 45], [700, 45]
    k_cache, v_cache, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.bfloat16, "cuda")
    qsl, lens = batch(q_lens, ctx_lens)
    qkv = torch.randn(sum(q_lens), (32 + 16) * 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :32 * 128].view(-1, 32, 128)
    args = (q, k_cache, v_cache, table, qsl, lens, max(q_lens), 128 ** -0.5)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    paged_prefill_attention_sm90(*args, out=out)  # compile outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention_sm90(*args, out=out)
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_prefill_attention(q.contiguous(), *args[1:])
    assert rel_err(out, ref) < 4e-3


# ------------------------------------------------------------------ sliding windows and logit soft-capping
def check_window(*args, stale: int | str | None = None, **kwargs) -> torch.Tensor:
    """``check_prefill_window`` on the Hopper kernel, with a failure that names a stale read: ``stale="nan"``
    points every table entry of a block wholly before a chunk's first window at a block of NaN, so a kernel that
    looks one up (the hybrid cache will have freed those blocks) turns the output into NaN through P·V, even
    where the key is masked (0 · NaN); ``stale=-1`` checks the kernel neither faults on nor needs them."""
    try:
        return check_prefill_window(*args, stale=stale, kernel=paged_prefill_attention_sm90, **kwargs)
    except AssertionError as exc:
        if stale == "nan" and "non-finite" in str(exc):
            raise AssertionError(
                f"NaN output with the entries before each window pointing at a NaN block ({kwargs}): a query tile "
                "read a block-table entry wholly outside its rows' windows (if the stale=-1 case of the same "
                "window passes, that is the only explanation; if it fails too, a row's softmax saw no key: the "
                "running max must start finite when a tile can hide all of a row's keys)") from exc
        raise


@pytest.mark.parametrize("stale", [-1, "nan"], ids=["minus1", "nan-block"])
@pytest.mark.parametrize("window", [5, 21, 37, 127, 128, 129, 1000])
def test_prefill_sm90_window(window: int, stale: int | str) -> None:
    """Windows inside a 16-token page, across pages, about one 128-key tile, and longer than some prompts, on
    Q_LENS's whole prompts, chunks starting mid-sequence and an overhanging tile: each 128-row query tile starts
    its key loop at the page of its first row's window, and masks the window's lower edge per element as it
    masks the causal diagonal (a row may see no key of the first tiles)."""
    check_window(Q_LENS, CTX_LENS, 32, 8, 128, 16, torch.bfloat16, "cuda", window=window, stale=stale)


@pytest.mark.parametrize("page", [32, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [37, 200])
def test_prefill_sm90_window_pages(page: int, head_dim: int, window: int) -> None:
    """Pages up to twice the 128-key tile: the key loop starts at the 128-key copy inside the page."""
    check_window(Q_LENS, CTX_LENS, 16, 4, head_dim, page, torch.bfloat16, "cuda", window=window, stale="nan")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(16, 8, 128), (32, 8, 64), (8, 8, 128), (32, 4, 128)],
                         ids=["qwen3-0.6b", "llama-3.2-1b", "mha", "gqa8"])
def test_prefill_sm90_window_shapes(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    check_window(Q_LENS, CTX_LENS, *shape, 16, dtype, "cuda", window=37, stale=-1)


@pytest.mark.parametrize("window", [100, 511, 512, 513, 4096])
def test_prefill_sm90_window_chunked(window: int) -> None:
    """Chunked prefill mid-sequence: 512-row chunks at positions 1024, 2560 and 3584 of their prompts (each query
    tile's window starts at a different page), a 100-row chunk and a single row, next to a whole prompt; windows
    around the chunk length, and one longer than every context."""
    q_lens, ctx_lens = [512, 512, 512, 100, 1, 300], [1536, 3072, 4096, 700, 2049, 300]
    check_window(q_lens, ctx_lens, 32, 8, 128, 16, torch.bfloat16, "cuda", window=window,
                 stale="nan" if window < 4096 else None)


@pytest.mark.parametrize("window", [0, 37, 1000], ids=["no-window", "window37", "window1000"])
@pytest.mark.parametrize("softcap", [50.0, 5.0])
def test_prefill_sm90_softcap(softcap: float, window: int) -> None:
    """Soft-capping alone and with a window. q scaled 10x puts the scaled scores at a spread of ~10: a cap of
    50 bends them, one of 5 saturates most (the cap must be applied to the natural score before log2 e)."""
    check_window(Q_LENS, CTX_LENS, 32, 8, 128, 16, torch.bfloat16, "cuda", window=window, softcap=softcap,
                 q_gain=10.0, stale="nan" if window else None)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("page,window,softcap", [(16, 21, 0.0), (16, 37, 50.0), (64, 129, 0.0), (256, 200, 30.0)],
                         ids=["p16-w21", "p16-w37-cap50", "p64-w129", "p256-w200-cap30"])
def test_prefill_sm90_quant_window(kv_dtype: str, page: int, window: int, softcap: float) -> None:
    """8-bit caches: the converter's per-key scale lookups start at the window too (a scale read before it would
    be NaN here)."""
    check_window(Q_LENS, CTX_LENS, 32, 8, 128, page, torch.bfloat16, "cuda", window=window, softcap=softcap,
                 kv_dtype=kv_dtype, q_gain=4.0 if softcap else 1.0, stale="nan")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_prefill_sm90_window_matches_triton(kv_dtype: str) -> None:
    """Against the Triton kernel with a window and a cap, on long prompts: both round P alike and accumulate in
    float32, so they agree far inside the tolerance against float64."""
    q_lens, ctx_lens = [4096, 1000], [4096, 3000]
    kf, vf, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.float32, "cuda")
    kc, vc, sc = kf.bfloat16(), vf.bfloat16(), {}
    if kv_dtype != "auto":
        kc, vc, ks, vs = quantize_paged_kv(kf, vf, kv_dtype)
        sc = dict(k_scale=ks, v_scale=vs)
    qsl, lens = batch(q_lens, ctx_lens)
    q = 4 * torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, kc, vc, table, qsl, lens, max(q_lens), 128 ** -0.5)
    fast = paged_prefill_attention_sm90(*args, window=1000, softcap=30.0, **sc)
    ref = paged_prefill_attention(*args, window=1000, softcap=30.0, **sc)
    assert rel_err(fast, ref) < 4e-3, rel_err(fast, ref)


# ------------------------------------------------------------------ attention sinks (gpt-oss)
GPT_OSS = (64, 8, 64)  # gpt-oss's heads: 64 query heads (8 per KV head) of 64 dims


def sinks_like(num_heads: int, value: float | None = None) -> torch.Tensor:
    """bf16 sinks (the model dtype) of both signs about the scores' spread, or all ``value``."""
    if value is not None:
        return torch.full((num_heads,), value, device="cuda", dtype=torch.bfloat16)
    return (2 * torch.randn(num_heads, device="cuda")).bfloat16()


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"], ids=["bf16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [0, 5, 128])
def test_prefill_sm90_sinks(kv_dtype: str | None, window: int) -> None:
    """Sinks alone and with windows (gpt-oss's 128 keys; 5, where a row sees no key of its block's first tiles), on
    Q_LENS's whole prompts, chunks mid-sequence and an overhanging tile, over 16- and 8-bit caches."""
    check_window(Q_LENS, CTX_LENS, *GPT_OSS, 16, torch.bfloat16, "cuda", window=window, kv_dtype=kv_dtype,
                 sinks=sinks_like(64), stale="nan" if window else None)


@pytest.mark.parametrize("window", [0, 5, 128])
def test_prefill_sm90_sinks_chunked(window: int) -> None:
    """Chunked prefill: 512-row chunks at positions 1024, 2560 and 3584 of their prompts, a 100-row chunk, a row."""
    q_lens, ctx_lens = [512, 512, 512, 100, 1, 300], [1536, 3072, 4096, 700, 2049, 300]
    check_window(q_lens, ctx_lens, *GPT_OSS, 16, torch.bfloat16, "cuda", window=window, sinks=sinks_like(64),
                 stale="nan" if window else None)


@pytest.mark.parametrize("value", [8.0, float("-inf")], ids=["plus8", "minus-inf"])
@pytest.mark.parametrize("window", [0, 5])
def test_prefill_sm90_sink_extremes(value: float, window: int) -> None:
    """A sink of +8 outweighs every score (the output shrinks, still exact); a -inf sink is no sink, also where a
    window hides every key of a tile from some rows (the running max must stay finite there)."""
    torch.manual_seed(13)
    got = check_window(Q_LENS, CTX_LENS, *GPT_OSS, 16, torch.bfloat16, "cuda", window=window,
                       sinks=sinks_like(64, value))
    torch.manual_seed(13)
    plain = check_window(Q_LENS, CTX_LENS, *GPT_OSS, 16, torch.bfloat16, "cuda", window=window)
    if value > 0:
        assert got.float().norm() < 0.5 * plain.float().norm()
    else:
        assert rel_err(got, plain) < 1e-3, rel_err(got, plain)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_prefill_sm90_sinks_match_triton(kv_dtype: str) -> None:
    """Against the Triton kernel with sinks, with and without a window, on long prompts: both start each row's max at
    its sink and add its term last, so they agree far inside the tolerance against float64."""
    q_lens, ctx_lens = [4096, 1000], [4096, 3000]
    kf, vf, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.float32, "cuda")
    kc, vc, sc = kf.bfloat16(), vf.bfloat16(), {}
    if kv_dtype != "auto":
        kc, vc, ks, vs = quantize_paged_kv(kf, vf, kv_dtype)
        sc = dict(k_scale=ks, v_scale=vs)
    qsl, lens = batch(q_lens, ctx_lens)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    sinks = sinks_like(32)
    for window in (0, 128):
        args = (q, kc, vc, table, qsl, lens, max(q_lens), 128 ** -0.5)
        fast = paged_prefill_attention_sm90(*args, window=window, sinks=sinks, **sc)
        ref = paged_prefill_attention(*args, window=window, sinks=sinks, **sc)
        assert rel_err(fast, ref) < 4e-3, (window, rel_err(fast, ref))
