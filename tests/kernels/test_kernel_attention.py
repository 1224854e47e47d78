"""Paged decode and prefill attention vs the float64 torch reference (CPU interpreter in CI)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    check_decode, check_decode_window, check_prefill, check_prefill_window, make_paged_kv, poison_before_window,
    rel_err, seed_per_case,
)
from minfer.kernels.attention.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref

PAGE = 16
# Ragged lengths: 1, page - 1, page, page + 1, five pages.
RAGGED = [1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_decode(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check_decode(RAGGED, num_heads, num_kv_heads, head_dim, PAGE, dtype, "cpu", num_splits=1)


@pytest.mark.parametrize("num_splits", [3, 8])
def test_decode_split_k(num_splits: int) -> None:
    # 8 splits of a 15-token context leave empty splits: the merge must ignore them.
    check_decode(RAGGED, 8, 2, 64, PAGE, torch.bfloat16, "cpu", num_splits=num_splits)


def test_decode_default_heuristic_and_wide_pages() -> None:
    check_decode([3, 70, 200], 4, 1, 32, 64, torch.float32, "cpu")


def test_decode_fp16_head_dim_256() -> None:
    check_decode([5, 33], 4, 2, 256, 16, torch.float16, "cpu", num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_prefill_varlen(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    # Whole prompts of different lengths: q_len == context_len.
    check_prefill([PAGE + 1, 1, 45], [PAGE + 1, 1, 45], num_heads, num_kv_heads, head_dim, PAGE, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_chunk_mid_sequence(dtype: torch.dtype) -> None:
    # Chunks that start after cached context (chunked prefill / prefix hit), mixed with a decode-like row
    # and a fresh prompt; q_len 40 spans two query blocks on the interpreter's 32-row tiles.
    check_prefill([40, 1, 7, PAGE], [5 * PAGE, 23, PAGE + 7, PAGE], 8, 2, 64, PAGE, dtype, "cpu")


def test_prefill_fp16_wide_pages() -> None:
    check_prefill([33, 9], [70, 9], 4, 4, 32, 32, torch.float16, "cpu")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=4),
    page=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 2, 4]),
    splits=st.integers(1, 5),
)
def test_decode_property(lens: list[int], page: int, group: int, splits: int) -> None:
    check_decode(lens, 2 * group, 2, 32, page, torch.float32, "cpu", num_splits=splits)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data(), page=st.sampled_from([16, 32]), group=st.sampled_from([1, 4]))
def test_prefill_property(data: st.DataObject, page: int, group: int) -> None:
    ctx = data.draw(st.lists(st.integers(1, 80), min_size=1, max_size=3))
    q_lens = [data.draw(st.integers(1, c)) for c in ctx]
    check_prefill(q_lens, ctx, 2 * group, 2, 32, page, torch.float32, "cpu")


# ------------------------------------------------------------------ sliding windows and logit soft-capping
# Windows that cut a 16-token page in the middle (5 < PAGE, 21 and 37 past one and two pages), each against
# contexts shorter than the window, equal to it, one past it and several pages past it.
WINDOWS = [5, 21, 37]


def _around(window: int) -> list[int]:
    return [1, window - 1, window, window + 1, 2 * window + 3, 90]


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window(window: int) -> None:
    check_decode_window(_around(window), 8, 2, 32, PAGE, torch.float32, "cpu", window=window, num_splits=1)


@pytest.mark.parametrize("num_splits", [None, 3, 8])
def test_decode_window_split_k(num_splits: int | None) -> None:
    # The splits divide the window's keys alone; 8 splits of a 5-token window leave empty ones.
    check_decode_window([3, 21, 22, 60, 90], 8, 2, 32, PAGE, torch.bfloat16, "cpu", window=21,
                        num_splits=num_splits)
    check_decode_window([5, 6, 70], 4, 1, 32, PAGE, torch.float32, "cpu", window=5, num_splits=num_splits)


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window(window: int) -> None:
    # Whole prompts; 70 rows span three 32-row query blocks on the interpreter's tiles.
    lens = [1, window, window + 1, 45, 70]
    check_prefill_window(lens, lens, 8, 2, 32, PAGE, torch.float32, "cpu", window=window)


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window_chunk_mid_sequence(window: int) -> None:
    # Chunks after cached context (chunked prefill), a decode-like row, a fresh prompt; GQA 4, bf16.
    check_prefill_window([40, 1, 7, PAGE, 33], [5 * PAGE, 23, PAGE + 7, PAGE, 100], 8, 2, 64, PAGE,
                         torch.bfloat16, "cpu", window=window)


def test_softcap() -> None:
    # Scores of spread ~1 against a cap of 1: the cap bends most of them.
    dec = check_decode_window([1, 20, 70], 8, 2, 32, PAGE, torch.float32, "cpu", softcap=1.0, num_splits=2)
    pre = check_prefill_window([20, 33], [20, 60], 8, 2, 32, PAGE, torch.float32, "cpu", softcap=1.0)
    # Saturation: scores in the hundreds against a cap of 30 (tanh's exponent overflows to inf, harmlessly).
    check_decode_window([40], 4, 1, 32, PAGE, torch.float32, "cpu", softcap=30.0, q_gain=300.0, num_splits=1)
    check_prefill_window([40], [40], 4, 1, 32, PAGE, torch.float32, "cpu", softcap=30.0, q_gain=300.0)
    assert dec.isfinite().all() and pre.isfinite().all()


def test_softcap_changes_the_output() -> None:
    torch.manual_seed(1)
    capped = check_decode_window([50], 2, 2, 32, PAGE, torch.float32, "cpu", softcap=1.0, num_splits=1)
    torch.manual_seed(1)
    plain = check_decode_window([50], 2, 2, 32, PAGE, torch.float32, "cpu", num_splits=1)
    assert rel_err(capped, plain) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_with_softcap(dtype: torch.dtype) -> None:
    check_decode_window([4, 21, 90], 8, 2, 32, PAGE, dtype, "cpu", window=21, softcap=2.0, num_splits=3)
    check_prefill_window([40, 7, 21], [90, 30, 21], 8, 2, 32, PAGE, dtype, "cpu", window=21, softcap=2.0)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_window_8bit_cache(kv_dtype: str) -> None:
    check_decode_window([3, 37, 90], 8, 2, 32, PAGE, torch.float32, "cpu", window=37, num_splits=2,
                        kv_dtype=kv_dtype, stale=-1)
    check_prefill_window([40, 9], [90, 30], 8, 2, 32, PAGE, torch.float32, "cpu", window=21, softcap=2.0,
                         kv_dtype=kv_dtype, stale=-1)


@pytest.mark.parametrize("stale", [-1, 2 ** 30, "nan"], ids=["minus1", "huge", "nan_block"])
def test_window_never_reads_blocks_before_it(stale: int | str) -> None:
    # Table entries of blocks wholly before every query's window hold -1, an id far past the cache, or the id
    # of a block of NaN: the interpreter fails at any load of them (kernel_testlib.forbid_table_reads), and the
    # outputs still match the reference on the intact table.
    for splits in (1, 4):
        check_decode_window([40, 90, 5 * PAGE + 3], 8, 2, 32, PAGE, torch.float32, "cpu", window=21,
                            num_splits=splits, stale=stale)
    check_prefill_window([40, 1, 20], [100, 50, 70], 8, 2, 32, PAGE, torch.float32, "cpu", window=21, stale=stale)
    check_prefill_window([3, 64], [80, 64], 4, 4, 32, PAGE, torch.bfloat16, "cpu", window=5, stale=stale)


def test_reference_matches_dense_attention() -> None:
    """The references against attention written out per query in float64: keys read one position at a time
    through the block table, the window and causality as index ranges, tanh from math."""
    page, hq, hkv, d, window, cap = 4, 4, 2, 8, 6, 1.5
    ctx_lens, q_lens = [3, 6, 7, 17], [3, 2, 1, 9]
    k_cache, v_cache, table = make_paged_kv(ctx_lens, hkv, d, page, torch.float64, "cpu")
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    qsl = torch.tensor([0] + q_lens).cumsum(0).int()
    q = torch.randn(sum(q_lens), hq, d, dtype=torch.float64)
    scale = 0.7
    dense = torch.empty_like(q)
    for s, (ctx, n) in enumerate(zip(ctx_lens, q_lens)):
        for i in range(n):
            p, row = ctx - n + i, int(qsl[s]) + i
            keys = range(max(0, p - window + 1), p + 1)
            slot = [(int(table[s, k // page]), k % page) for k in keys]
            for h in range(hq):
                kv = h // (hq // hkv)
                logits = [cap * math.tanh(scale * float(q[row, h] @ k_cache[b, o, kv]) / cap) for b, o in slot]
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                dense[row, h] = sum(wj * v_cache[b, o, kv] for wj, (b, o) in zip(w, slot)) / sum(w)
    poisoned = poison_before_window(table, [c - n for c, n in zip(ctx_lens, q_lens)], window, page, 2 ** 30)
    got = paged_prefill_attention_ref(q, k_cache, v_cache, poisoned, qsl, lens, max(q_lens), scale,
                                      window=window, softcap=cap)
    torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-12)
    last = (qsl[1:] - 1).long()  # each sequence's last query is its decode query
    got = paged_decode_attention_ref(q[last], k_cache, v_cache, table, lens, scale, window=window, softcap=cap)
    torch.testing.assert_close(got, dense[last], rtol=1e-12, atol=1e-12)



# ------------------------------------------------------------------ the same at real shapes on a GPU (-m gpu)
# A window of 1000 keys (62.5 pages) against contexts around it and far past it. On the GPU a -1 table entry that
# the kernel looked up would be a fault or a wrong page; the interpreter tests above prove it is never loaded.
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_SHAPES = [(32, 8, 128), (32, 8, 64)]
GPU_SHAPE_IDS = ["llama-3.1-8b", "llama-3.2-1b"]
GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7], ids=["auto", "s1", "s7"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=GPU_SHAPE_IDS)
def test_decode_window_gpu(shape: tuple[int, int, int], dtype: torch.dtype, num_splits: int | None) -> None:
    check_decode_window([1, 15, 999, 1000, 1001, 2500, 9000], *shape, PAGE, dtype, "cuda", window=1000,
                        num_splits=num_splits, stale=-1)
    check_decode_window([1, 1000, 5000], *shape, PAGE, dtype, "cuda", window=1000, softcap=50.0, q_gain=8.0,
                        num_splits=num_splits, stale=2 ** 30)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=GPU_SHAPE_IDS)
def test_prefill_window_gpu(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    # A whole prompt past the window, a chunk mid-sequence, a single-row chunk, a prompt inside the window.
    check_prefill_window([3000, 300, 1, 77], [3000, 2000, 1513, 77], *shape, PAGE, dtype, "cuda", window=1000,
                         stale=-1)
    check_prefill_window([1500, 1], [1500, 4000], *shape, PAGE, dtype, "cuda", softcap=50.0, q_gain=8.0)
    check_prefill_window([1500, 1], [1500, 4000], *shape, PAGE, dtype, "cuda", window=333, softcap=50.0, q_gain=8.0,
                         stale=-1)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_window_8bit_cache_gpu(kv_dtype: str) -> None:
    for splits in (None, 1, 7):
        check_decode_window([1, 1000, 1001, 9000], 32, 8, 128, PAGE, torch.bfloat16, "cuda", window=1000,
                            num_splits=splits, kv_dtype=kv_dtype, stale=-1)
    check_prefill_window([3000, 300, 1], [3000, 2000, 1513], 32, 8, 128, PAGE, torch.bfloat16, "cuda", window=1000,
                         softcap=50.0, kv_dtype=kv_dtype, stale=-1)


# ------------------------------------------------------------------ attention sinks (gpt-oss)
def hf_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                      sinks: torch.Tensor) -> torch.Tensor:
    """HF transformers' gpt-oss ``eager_attention_forward`` for one sequence, written out: q [Hq, Q, D], k/v
    [Hkv, L, D] repeated per query head, ``visible`` [Q, L]; the sink logit per head catted as the last column,
    the max subtracted, the softmax taken, the sink's column dropped before P·V."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    combined = torch.cat([scores, sinks.reshape(-1, 1, 1).expand(-1, q.shape[1], -1).to(scores.dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


def sink_case(dtype: torch.dtype = torch.float64, window: int = 0) -> tuple:
    """A small paged batch (GQA 2, pages of 4, ragged chunks, the last row of each a decode query) with sinks
    of both signs, and HF's output for it: (q, caches, table, qsl, lens, q_lens, scale, sinks, hf)."""
    page, hq, hkv, d, scale = 4, 4, 2, 8, 0.7
    ctx_lens, q_lens = [3, 6, 7, 17], [3, 2, 1, 9]
    k_cache, v_cache, table = make_paged_kv(ctx_lens, hkv, d, page, dtype, "cpu")
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    qsl = torch.tensor([0] + q_lens).cumsum(0).int()
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=dtype)
    hf = torch.empty_like(q)
    for s, (ctx, n) in enumerate(zip(ctx_lens, q_lens)):
        pos = torch.arange(ctx)
        slots = table[s, pos // page].long() * page + pos % page
        k = k_cache.view(-1, hkv, d)[slots].transpose(0, 1)
        v = v_cache.view(-1, hkv, d)[slots].transpose(0, 1)
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        visible = (pos[None, :] <= q_pos) & ((pos[None, :] > q_pos - window) if window else True)
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        hf[rows] = hf_sink_attention(q[rows].transpose(0, 1), k, v, visible, scale, sinks).transpose(0, 1)
    return q, k_cache, v_cache, table, qsl, lens, q_lens, scale, sinks, hf


@pytest.mark.parametrize("window", [0, 5])
def test_reference_with_sinks_is_hfs_formula(window: int) -> None:
    """The kernels' references with sinks equal HF's gpt-oss attention (float64, a window or none)."""
    q, kc, vc, table, qsl, lens, q_lens, scale, sinks, hf = sink_case(window=window)
    got = paged_prefill_attention_ref(q, kc, vc, table, qsl, lens, max(q_lens), scale, window=window, sinks=sinks)
    torch.testing.assert_close(got, hf, rtol=1e-12, atol=1e-12)
    last = (qsl[1:] - 1).long()
    got = paged_decode_attention_ref(q[last], kc, vc, table, lens, scale, window=window, sinks=sinks)
    torch.testing.assert_close(got, hf[last], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [0, 5])
def test_torch_ops_with_sinks_are_hfs_formula(window: int) -> None:
    """The engine's CPU path (``ops/torch_attention.py``) with sinks, in float32, against HF's formula: decodes
    first, then the prompt chunks, as a step lays them out."""
    from minfer.ops import AttentionMetadata
    from minfer.ops.torch_attention import torch_decode_attention, torch_prefill_attention

    q, kc, vc, table, qsl, lens, q_lens, scale, sinks, hf = sink_case(window=window)
    last = (qsl[1:] - 1).long()
    order = torch.cat([last[:2], torch.arange(int(qsl[2]), int(qsl[-1]))])  # sequences 0, 1 decode their last row
    q32, kc, vc, sinks = q[order].float(), kc.float(), vc.float(), sinks.float()
    ctx = lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=[torch.empty(0, dtype=torch.long)], block_tables=[table], context_lens=lens, num_decodes=2,
        block_size=4, context_lens_host=[ctx[0], ctx[1], ctx[2], ctx[3]], query_lens_host=[1, 1] + q_lens[2:])
    dec = torch_decode_attention(q32[:2], kc, vc, meta, scale, window=window, sinks=sinks)
    torch.testing.assert_close(dec, hf[last[:2]].float(), rtol=1e-5, atol=1e-5)
    pre = torch_prefill_attention(q32, kc, vc, meta, scale, window=window, sinks=sinks)
    torch.testing.assert_close(pre, hf[int(qsl[2]):].float(), rtol=1e-5, atol=1e-5)


def head_sinks(num_heads: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sinks of both signs around the scores' spread (N(0, 1)-ish at these shapes), as trained ones are."""
    return (2 * torch.randn(num_heads, device=device)).to(dtype)


@pytest.mark.parametrize("num_splits,window", [(1, 0), (4, 0), (3, 21)], ids=["direct", "split4", "split3-window21"])
def test_decode_sinks(num_splits: int, window: int) -> None:
    # Split 0 alone counts the sink; 4 splits of a 1-token context leave empty ones, with no sink either.
    check_decode_window([1, 15, 40, 90], 8, 2, 32, PAGE, torch.bfloat16, "cpu", window=window, num_splits=num_splits,
                        sinks=head_sinks(8, dtype=torch.bfloat16), stale=-1 if window else None)


@pytest.mark.parametrize("window", [0, 21])
def test_prefill_sinks(window: int) -> None:
    # Chunks after cached context (chunked prefill), a single row, a fresh prompt; GQA 4.
    check_prefill_window([40, 1, 7, 33], [80, 23, 23, 33], 8, 2, 32, PAGE, torch.float32, "cpu", window=window,
                         sinks=head_sinks(8), stale=-1 if window else None)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_sinks_8bit_cache(kv_dtype: str) -> None:
    check_decode_window([3, 37, 90], 8, 2, 32, PAGE, torch.float32, "cpu", window=37, num_splits=2,
                        kv_dtype=kv_dtype, sinks=head_sinks(8))
    check_prefill_window([40, 9], [90, 30], 8, 2, 32, PAGE, torch.float32, "cpu", window=21, kv_dtype=kv_dtype,
                         sinks=head_sinks(8))


def test_sinks_with_softcap() -> None:
    """Soft-capping and sinks do not meet in real models; the cap bends the scores, never the sink."""
    check_decode_window([20, 70], 4, 1, 32, PAGE, torch.float32, "cpu", softcap=1.0, num_splits=2, sinks=head_sinks(4))
    check_prefill_window([20, 33], [20, 60], 4, 1, 32, PAGE, torch.float32, "cpu", softcap=1.0, sinks=head_sinks(4))


def test_a_dominant_sink() -> None:
    """A sink of +8 outweighs the scores (spread ~1): the output shrinks by ~e^8 / context and stays exact."""
    big = torch.full((4,), 8.0)
    torch.manual_seed(3)
    dec = check_decode_window([5, 60], 4, 2, 32, PAGE, torch.float32, "cpu", num_splits=3, sinks=big)
    torch.manual_seed(3)
    plain = check_decode_window([5, 60], 4, 2, 32, PAGE, torch.float32, "cpu", num_splits=3)
    assert dec.norm() < 0.2 * plain.norm()
    check_prefill_window([30, 7], [50, 7], 4, 2, 32, PAGE, torch.float32, "cpu", window=21, sinks=big)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # -inf - -inf in a where's unused branch
@pytest.mark.parametrize("sink", [float("-inf"), -1e4], ids=["minus-inf", "minus-1e4"])
def test_a_vanishing_sink_is_no_sink(sink: float) -> None:
    """A sink no score can reach adds exp2(-inf) = 0 to the denominator and starts no running max above a score:
    the output is the one without sinks, bit for bit (with windows whose lower edge hides every key of a tile from
    some rows, and empty splits)."""
    sinks = torch.full((8,), sink)
    for fn, args, how in ((check_decode_window, ([1, 15, 40, 90],), dict(window=21, num_splits=4)),
                          (check_prefill_window, ([40, 1, 33], [80, 23, 33]), dict(window=5))):
        torch.manual_seed(5)
        with_sinks = fn(*args, 8, 2, 32, PAGE, torch.float32, "cpu", sinks=sinks, **how)
        torch.manual_seed(5)
        without = fn(*args, 8, 2, 32, PAGE, torch.float32, "cpu", **how)
        assert torch.equal(with_sinks, without), fn.__name__


def test_sinks_are_checked() -> None:
    from minfer.kernels.attention.decode_attention import paged_decode_attention

    k_cache, v_cache, table = make_paged_kv([5], 2, 32, PAGE, torch.float32, "cpu")
    q, lens = torch.randn(1, 8, 32), torch.tensor([5], dtype=torch.int32)
    for bad in (torch.zeros(4), torch.zeros(8, dtype=torch.int32), torch.zeros(16)[::2]):
        with pytest.raises(ValueError, match="sinks"):
            paged_decode_attention(q, k_cache, v_cache, table, lens, 0.2, sinks=bad)
