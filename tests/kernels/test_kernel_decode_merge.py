"""Split-K decode with the merge in the split kernel (the last live split of each (sequence, KV head) merges,
through an atomic counter) against the two-launch path and the float64 reference (CPU interpreter in CI; the
Hopper kernel's counterpart is ``test_kernel_decode_merge_gpu.py``, which reuses ``check_merge_paths``).

What the counter design must survive: empty splits (contexts shorter than the splits' tiles: they must neither
count nor be read), one live split, GQA groups of 1 to 8 heads, 8-bit caches, windows and sinks, and repeated
calls on one counter buffer (as CUDA-graph replays and a model's layers share it): after every call each counter
is back to zero."""

import functools

import pytest
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    assert_close, check_decode_window, make_paged_kv, quantize_paged_kv, rel_err, seed_per_case,
)
from minfer.kernels.attention.attention_ref import paged_decode_attention_ref
from minfer.kernels.attention.decode_attention import paged_decode_attention
from minfer.kernels.attention.decode_merge import fused_merge_enabled, split_counters

PAGE = 16
# One key, a page less one, a tile (32 keys under the interpreter) and one, and longer ones: with 7 splits every
# sequence but the longest has empty splits, the first two a single live one.
RAGGED = [1, 15, 33, 100, 300]


def assert_counters_zero(device: torch.device) -> None:
    counters = split_counters(device, 0)
    assert int(counters.count_nonzero()) == 0, f"counters left non-zero: {counters.nonzero().flatten().tolist()}"


def check_merge_paths(kernel, ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                      dtype: torch.dtype, device: str, num_splits: int | None, *, kv_dtype: str | None = None,
                      calls: int = 2, exact: bool = False, tol: float = 0.0) -> None:
    """``kernel`` with the fused merge and with two launches, each ``calls`` times on the same output (poisoned
    with NaN before each call), against the float64 reference; the counters zero after every fused call. The two
    paths agree bit for bit when ``exact`` (the same merge arithmetic), else within ``tol`` relative error."""
    kf, vf, table = make_paged_kv(ctx_lens, num_kv_heads, head_dim, page, torch.float32 if kv_dtype else dtype,
                                  device)
    scales = {}
    if kv_dtype:
        kf, vf, ks, vs = quantize_paged_kv(kf, vf, kv_dtype)
        scales = dict(k_scale=ks, v_scale=vs)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    up = (lambda t: t) if kv_dtype else (lambda t: t.double())
    ref = paged_decode_attention_ref(q.double(), up(kf), up(vf), table, lens, scale, **scales)
    outs = {}
    for fused in (False, True):
        out = torch.empty_like(q)
        for call in range(calls):
            out.fill_(float("nan"))
            kernel(q, kf, vf, table, lens, scale, out=out, num_splits=num_splits, fused_merge=fused, **scales)
            if fused:
                assert_counters_zero(q.device)
            assert_close(out, ref, dtype, f"decode fused={fused} splits={num_splits} call {call}")
        outs[fused] = out
    if exact:
        assert torch.equal(outs[True], outs[False]), "the fused merge's output differs from the merge kernel's"
    else:
        assert rel_err(outs[True], outs[False]) <= tol, rel_err(outs[True], outs[False])


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_fused_merge_matches_two_launches(num_heads: int, num_kv_heads: int, num_splits: int) -> None:
    check_merge_paths(paged_decode_attention, RAGGED, num_heads, num_kv_heads, 32, PAGE, torch.float32, "cpu",
                      num_splits, exact=True)


def test_fused_merge_bf16_and_many_splits() -> None:
    """bf16 output, and more splits than a merge chunk (16) reads at once, most of them empty."""
    check_merge_paths(paged_decode_attention, [1, 40, 700], 8, 2, 64, PAGE, torch.bfloat16, "cpu", 20, exact=True)


def test_fused_merge_8bit_cache() -> None:
    check_merge_paths(paged_decode_attention, RAGGED, 8, 2, 64, PAGE, torch.float32, "cpu", 3, kv_dtype="int8",
                      exact=True)


@pytest.mark.parametrize("num_splits", [3, 7])
def test_fused_merge_window_and_sinks(num_splits: int) -> None:
    """A window's splits cut its range alone, so its live splits are counted from the window's start; split 0
    counts the sinks."""
    fused = functools.partial(paged_decode_attention, fused_merge=True)
    check_decode_window([3, 21, 22, 60, 90], 8, 2, 32, PAGE, torch.float32, "cpu", window=21, num_splits=num_splits)
    check_decode_window([3, 21, 22, 60, 90], 8, 2, 32, PAGE, torch.float32, "cpu", window=21, num_splits=num_splits,
                        kernel=fused)
    sinks = torch.randn(8)
    check_decode_window([1, 15, 40, 90], 8, 2, 32, PAGE, torch.bfloat16, "cpu", window=37, num_splits=num_splits,
                        kernel=fused, sinks=sinks)
    assert_counters_zero(torch.device("cpu"))


def test_counters_shared_across_shapes() -> None:
    """Calls of other batch sizes and head counts (a model's layers, graph buckets) reuse one buffer: each leaves
    it zero for the next."""
    for lens, heads, kv_heads, splits in (([300], 8, 2, 7), ([5, 300, 9], 4, 4, 3), ([300], 8, 2, 2)):
        check_merge_paths(paged_decode_attention, lens, heads, kv_heads, 32, PAGE, torch.float32, "cpu", splits,
                          calls=1, exact=True)


def test_the_env_var_picks_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINFER_DECODE_FUSED_MERGE", raising=False)
    assert fused_merge_enabled() and not fused_merge_enabled(False)
    monkeypatch.setenv("MINFER_DECODE_FUSED_MERGE", "0")
    assert not fused_merge_enabled() and fused_merge_enabled(True)
