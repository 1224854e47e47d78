"""Shared case builders and checks for the kernel tests (CPU interpreter and GPU alike).

Every check: fresh random data, the output poisoned with NaN before the kernel runs (an unwritten
element fails), and a torch reference evaluated in float64 on upcast inputs.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import zlib
from collections.abc import Iterator

# Must precede the first `import triton` (Triton reads it when kernels are decorated). minfer.kernels
# does the same when CUDA is absent; this also covers a CUDA build of torch on a GPU-less machine.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minfer.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from minfer.kernels.attention.decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from minfer.kernels.attention.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from minfer.kernels.kv_store import store_kv, store_kv_ref  # noqa: E402
from minfer.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402


@pytest.fixture(autouse=True)
def seed_per_case(request: pytest.FixtureRequest) -> None:
    """Fresh, reproducible random data per parametrised case (seed derived from the test id).

    Lives here, imported by each kernel test module, rather than in a tests/kernels/conftest.py:
    a second `conftest` module on sys.path would shadow tests/conftest.py for `from conftest import`.
    """
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


# Triton's CPU interpreter (3.9) rounds float32 -> bfloat16 toward zero, where GPUs and torch round to
# nearest even; bit-exact bf16 comparisons with torch therefore only hold off the interpreter.
EXACT_BF16 = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "on", "yes")

# Relative Frobenius error allowed per dtype (fp32 attention dots are exact-IEEE, so 1e-4 holds).
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten element or overflow)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    err = rel_err(out, ref)
    assert err <= REL_TOL[dtype], f"{what} rel err {err:.3e} > {REL_TOL[dtype]:.0e} ({dtype})"


def distinct_logits(t: int, e: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """MoE router logits ``[t, e]`` with no tie in a row, exact in every float dtype: each row a random
    permutation of an evenly spaced grid about 4 wide (qwen3's 128 experts: steps of 1/32). (Random bfloat16
    logits tie often enough to matter, and ``torch.topk`` breaks a tie at the k-th place its own way; the MoE
    tests test ties on their own.)"""
    step = 2.0 ** round(math.log2(4 / e))
    grid = torch.stack([torch.randperm(e) for _ in range(t)]).float() * step - 2
    return grid.to(device=device, dtype=dtype)


def make_paged_kv(ctx_lens: list[int], num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                  device: str, spare_blocks: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches and int32 block tables: blocks drawn from a random permutation (non-contiguous),
    rows padded with other valid ids so a kernel that reads past its context reads wrong data."""
    need = [math.ceil(c / page) for c in ctx_lens]
    width = max(need) + 1
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks)
    table = torch.randint(0, num_blocks, (len(ctx_lens), width), dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        table[s, :n] = perm[used:used + n].int()
        used += n
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    return k_cache, v_cache, table.to(device)


def check_decode(ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                 dtype: torch.dtype, device: str, num_splits: int | None = None, kernel=paged_decode_attention) -> None:
    k_cache, v_cache, table = make_paged_kv(ctx_lens, num_kv_heads, head_dim, page, dtype, device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, table, lens, scale, out=out, num_splits=num_splits)
    ref = paged_decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, lens, scale)
    assert_close(out, ref, dtype, f"decode splits={num_splits}")
    # The reference in the model dtype is the engine's fallback: it must agree too.
    assert_close(paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale), ref, dtype, "decode ref")


def check_prefill(q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                  page: int, dtype: torch.dtype, device: str, kernel=paged_prefill_attention) -> None:
    k_cache, v_cache, table = make_paged_kv(ctx_lens, num_kv_heads, head_dim, page, dtype, device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().to(device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, table, qsl, lens, max(q_lens), scale, out=out)
    ref = paged_prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), table, qsl, lens,
                                      max(q_lens), scale)
    assert_close(out, ref, dtype, "prefill")


def check_store_kv(num_tokens: int, num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                   device: str) -> None:
    num_blocks = num_tokens // page + 4
    # k, v as strided views of a fused qkv output, as the engine produces them.
    qkv = torch.randn(num_tokens, (2 + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    k = qkv[:, 2 * head_dim:(2 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (2 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * page, device=device)[:num_tokens]
    slots[::3] = -1  # padding rows
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    # A copy: bit-exact, and untouched slots (NaN) must stay untouched.
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert k_cache.isnan().sum() == k_ref.isnan().sum() > 0


def check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, device: str) -> None:
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    residual = torch.randn(num_tokens, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    eps = 1e-6
    assert_close(rms_norm(x, weight, eps), rms_norm_ref(x.double(), weight.double(), eps), dtype, "rms_norm")
    # Per-head norms read in place from a strided [T, heads, H] view (Qwen3's q/k norms on the qkv output).
    qkv = torch.randn(num_tokens, 5 * hidden, device=device).to(dtype)
    heads = qkv[:, hidden:4 * hidden].view(num_tokens, 3, hidden)
    assert_close(rms_norm(heads, weight, eps), rms_norm_ref(heads.double(), weight.double(), eps), dtype,
                 "rms_norm on strided heads")
    res = residual.clone()
    out = fused_add_rms_norm(x, res, weight, eps)
    res_ref = residual.clone()
    out_same = fused_add_rms_norm_ref(x, res_ref, weight, eps)
    if dtype != torch.bfloat16 or EXACT_BF16:
        assert torch.equal(res, res_ref), "residual must be x + residual rounded to the dtype"
    else:
        torch.testing.assert_close(res, res_ref, rtol=1e-2, atol=1e-2)
    ref = rms_norm_ref(res_ref.double(), weight.double(), eps)
    assert_close(out, ref, dtype, "fused_add_rms_norm")
    # Same dtype, same roundings as HF: at most one ulp apart (rsqrt approximations differ).
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if EXACT_BF16 else 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, out_same, rtol=tol, atol=tol)


def check_silu_and_mul(num_tokens: int, inter: int, dtype: torch.dtype, device: str) -> None:
    x = (2 * torch.randn(num_tokens, 2 * inter, device=device)).to(dtype)
    out = silu_and_mul(x)
    assert_close(out, silu_and_mul_ref(x.double()), dtype, "silu_and_mul")
    # Against HF's own rounding in the same dtype: one ulp (two under the interpreter's truncation).
    rtol = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if EXACT_BF16 else 3e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=rtol, atol=1e-5)


# ------------------------------------------------------------------------------------ 8-bit KV caches
def quantize_paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_dtype: str,
                      scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    """(k codes, v codes, k_scale, v_scale) of float caches ``[blocks, page, Hkv, D]`` in format ``kv_dtype``,
    scales in the paged layout ``[blocks, Hkv, page]``."""
    from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS, quantize_ref

    fmt = KV_QUANT_FORMATS[kv_dtype]
    kc, ks = quantize_ref(k_cache, fmt, scale_dtype)
    vc, vs = quantize_ref(v_cache, fmt, scale_dtype)
    return kc, vc, ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()


def _outlier_kv(shape: tuple[int, ...], device: str) -> torch.Tensor:
    """Random K/V with per-(token, head) magnitudes over three decades and a few large channels, as
    real K has: what per-token-per-head scales are for."""
    x = torch.randn(shape, device=device) * torch.exp(3 * torch.rand(*shape[:-1], 1, device=device) - 1.5)
    x[..., :2] *= 8
    return x


def check_decode_quant(ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                       kv_dtype: str, dtype: torch.dtype, device: str, num_splits: int | None = None,
                       max_quant_err: float | None = None, config=None, kernel=paged_decode_attention,
                       scale_dtype: torch.dtype = torch.float16) -> None:
    """The kernel on an 8-bit cache vs the float64 reference on the same codes and scales (K/V with
    outliers). With ``max_quant_err``, K/V are plain N(0, 1) instead, and the quantization's own
    effect (vs attention over the unquantized cache) must stay under it. ``config``: a
    ``DecodeConfig`` instead of the device default (the Triton kernel's; ``kernel``: another entry point)."""
    kf, vf, table = make_paged_kv(ctx_lens, num_kv_heads, head_dim, page, torch.float32, device)
    if max_quant_err is None:
        kf, vf = _outlier_kv(kf.shape, device), _outlier_kv(vf.shape, device)
    kc, vc, ks, vs = quantize_paged_kv(kf, vf, kv_dtype, scale_dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernel(q, kc, vc, table, lens, scale, out=out, k_scale=ks, v_scale=vs, num_splits=num_splits,
           **({"config": config} if config is not None else {}))
    ref = paged_decode_attention_ref(q.double(), kc, vc, table, lens, scale, k_scale=ks, v_scale=vs)
    assert_close(out, ref, dtype, f"decode {kv_dtype} splits={num_splits} config={config}")
    if max_quant_err is not None:
        exact = paged_decode_attention_ref(q.double(), kf.double(), vf.double(), table, lens, scale)
        err = rel_err(ref, exact)
        assert err <= max_quant_err, f"{kv_dtype} cache changes decode attention by {err:.3e} > {max_quant_err}"


def check_prefill_quant(q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                        page: int, kv_dtype: str, dtype: torch.dtype, device: str,
                        kernel=paged_prefill_attention) -> None:
    kf, vf, table = make_paged_kv(ctx_lens, num_kv_heads, head_dim, page, torch.float32, device)
    kc, vc, ks, vs = quantize_paged_kv(_outlier_kv(kf.shape, device), _outlier_kv(vf.shape, device), kv_dtype)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().to(device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    kernel(q, kc, vc, table, qsl, lens, max(q_lens), scale, out=out, k_scale=ks, v_scale=vs)
    ref = paged_prefill_attention_ref(q.double(), kc, vc, table, qsl, lens, max(q_lens), scale, k_scale=ks, v_scale=vs)
    assert_close(out, ref, dtype, f"prefill {kv_dtype}")


def check_store_kv_quant(num_tokens: int, num_kv_heads: int, head_dim: int, page: int, kv_dtype: str,
                         dtype: torch.dtype, scale_dtype: torch.dtype, device: str) -> None:
    """Kernel vs reference: the same codes and scales bit for bit; untouched slots stay untouched."""
    from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS

    code_dtype = KV_QUANT_FORMATS[kv_dtype].dtype
    num_blocks = num_tokens // page + 4
    qkv = _outlier_kv((num_tokens, 2 + 2 * num_kv_heads, head_dim), device).reshape(num_tokens, -1).to(dtype)
    qkv[1, 2 * head_dim:] = 0  # an all-zero row: scale must stay finite, codes zero
    k = qkv[:, 2 * head_dim:(2 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (2 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * page, device=device)[:num_tokens]
    slots[::3] = -1  # padding rows
    sentinel = torch.full((num_blocks, page, num_kv_heads, head_dim), 0x5A, dtype=torch.uint8, device=device)
    k_cache, v_cache = sentinel.clone().view(code_dtype), sentinel.clone().view(code_dtype)
    k_scale = torch.full((num_blocks, num_kv_heads, page), float("nan"), dtype=scale_dtype, device=device)
    v_scale = k_scale.clone()
    k_ref, v_ref, ks_ref, vs_ref = k_cache.clone(), v_cache.clone(), k_scale.clone(), v_scale.clone()
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    store_kv_ref(k, v, k_ref, v_ref, slots, ks_ref, vs_ref)
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{kv_dtype} codes differ"
    for got, want in ((k_scale, ks_ref), (v_scale, vs_ref)):
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), f"{kv_dtype} scales differ"
    written = slots[slots >= 0]
    assert k_scale.isnan().sum() == k_scale.numel() - written.numel() * num_kv_heads, "scales written off-slot"
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=device)
    untouched[written] = False
    assert (k_cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[untouched] == 0x5A).all()
    assert torch.isfinite(k_scale.view(-1)).sum() > 0 and (k_scale[~k_scale.isnan()] > 0).all()


# ------------------------------------------------------------------ sliding windows and logit soft-capping
def poison_before_window(table: torch.Tensor, first_pos: list[int], window: int, page: int,
                         stale: int) -> torch.Tensor:
    """A copy of ``table`` whose entries for blocks wholly before every query's window (each sequence's first
    query at ``first_pos[s]``) hold ``stale``: what a hybrid cache leaves there after freeing them (-1, or an id
    past the cache). A kernel that looked one up would read out of bounds or wrong data."""
    table = table.clone()
    for s, p in enumerate(first_pos):
        table[s, :max(0, p - window + 1) // page] = stale
    return table


@contextlib.contextmanager
def forbid_table_reads(table: torch.Tensor, intact: torch.Tensor) -> Iterator[list[int]]:
    """Under the interpreter, fail at the first load of an entry where ``table`` differs from ``intact``: the proof
    that a kernel never looks at those entries, which its output cannot give (a stale id fetched for a key that is
    then masked out leaves the output right; on a GPU a -1 or freed block's id read that way is a fault or a wrong
    page). The check runs before the load returns, so the kernel never goes on to use a wild id. Yields a
    one-element count of the table entries read (a recording that saw no table load proves nothing)."""
    from triton.runtime import interpreter

    base, size = table.data_ptr(), table.element_size()
    stale = (table != intact).cpu().numpy()
    builder = interpreter.interpreter_builder
    original = builder.create_masked_load
    count = [0]

    def load(ptrs, mask, *args):
        addr = np.asarray(ptrs.data)
        addr = addr[np.broadcast_to(np.asarray(mask.data), addr.shape)].astype(np.int64)
        addr = addr[(addr >= base) & (addr < base + table.numel() * size)]
        rows, cols = np.divmod((addr - base) // size, table.stride(0))
        hits = stale[rows, cols]
        bad = sorted({(int(r), int(c)) for r, c in zip(rows[hits], cols[hits])})
        assert not bad, f"loaded table entries (row, block) before the window: {bad}"
        count[0] += addr.size
        return original(ptrs, mask, *args)

    builder.create_masked_load = load  # an instance attribute over the method, removed on exit
    try:
        yield count
    finally:
        del builder.create_masked_load


def _watching(kernel_table: torch.Tensor, table: torch.Tensor,
              stale: int | str | None) -> contextlib.AbstractContextManager:
    """``forbid_table_reads`` when the table is poisoned and the interpreter runs the kernel."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "on", "yes")
    if stale is None or not interpreting:
        return contextlib.nullcontext([1])
    return forbid_table_reads(kernel_table, table)


def _window_case(ctx_lens: list[int], first_pos: list[int], num_kv_heads: int, head_dim: int, page: int,
                 dtype: torch.dtype, device: str, window: int, kv_dtype: str | None,
                 stale: int | str | None) -> tuple[tuple[torch.Tensor, ...], dict, torch.Tensor, torch.Tensor]:
    """(kernel's caches, their scales as kwargs, kernel's table, reference's table). ``stale``: an id written
    into the kernel's table before the window (``poison_before_window``), or "nan": those entries point to a
    spare block of NaN (a read there poisons the output)."""
    cache_dtype = torch.float32 if kv_dtype else dtype
    k_cache, v_cache, table = make_paged_kv(ctx_lens, num_kv_heads, head_dim, page, cache_dtype, device)
    scales: dict = {}
    if kv_dtype:
        k_cache, v_cache = _outlier_kv(k_cache.shape, device), _outlier_kv(v_cache.shape, device)
        k_cache, v_cache, ks, vs = quantize_paged_kv(k_cache, v_cache, kv_dtype)
        scales = dict(k_scale=ks, v_scale=vs)
    kernel_table = table
    if stale == "nan":
        nan_block = torch.full((1, *k_cache.shape[1:]), float("nan"), device=device).to(k_cache.dtype)
        k_cache, v_cache = torch.cat([k_cache, nan_block]), torch.cat([v_cache, nan_block])
        for name in scales:  # NaN codes do not exist in int8: the block's scales carry the NaN
            sc = scales[name]
            scales[name] = torch.cat([sc, torch.full((1, *sc.shape[1:]), float("nan"), dtype=sc.dtype, device=device)])
        kernel_table = poison_before_window(table, first_pos, window, page, k_cache.shape[0] - 1)
    elif stale is not None:
        kernel_table = poison_before_window(table, first_pos, window, page, stale)
    if stale is not None:
        assert (kernel_table != table).any(), "the case has no block wholly before its window"
    return (k_cache, v_cache), scales, kernel_table, table


def check_decode_window(ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                        dtype: torch.dtype, device: str, window: int = 0, softcap: float = 0.0,
                        num_splits: int | None = None, kv_dtype: str | None = None, stale: int | str | None = None,
                        q_gain: float = 1.0, kernel=paged_decode_attention,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode with a sliding window, soft cap and/or attention ``sinks`` ``[num_heads]`` vs the float64 reference (on
    the same codes and scales for an 8-bit ``kv_dtype``), the kernel's table poisoned before each window when
    ``stale`` is set. ``q_gain`` scales q, so scores reach the cap's saturation. Returns the kernel's output."""
    (k_cache, v_cache), scales, kernel_table, table = _window_case(
        ctx_lens, [c - 1 for c in ctx_lens], num_kv_heads, head_dim, page, dtype, device, window, kv_dtype, stale)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    q = (q_gain * torch.randn(len(ctx_lens), num_heads, head_dim, device=device)).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    with _watching(kernel_table, table, stale) as table_reads:
        kernel(q, k_cache, v_cache, kernel_table, lens, scale, out=out, num_splits=num_splits, window=window,
               softcap=softcap, **scales, **_sinks(sinks))
    assert table_reads[0] > 0, "no block-table load was seen"
    up = (lambda t: t) if kv_dtype else (lambda t: t.double())
    ref = paged_decode_attention_ref(q.double(), up(k_cache), up(v_cache), table, lens, scale, window=window,
                                     softcap=softcap, **scales, **_sinks(sinks, torch.float64))
    assert_close(out, ref, dtype, f"decode window={window} softcap={softcap} splits={num_splits} {kv_dtype or ''}"
                 f"{' sinks' if sinks is not None else ''}")
    return out


def check_prefill_window(q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                         page: int, dtype: torch.dtype, device: str, window: int = 0, softcap: float = 0.0,
                         kv_dtype: str | None = None, stale: int | str | None = None, q_gain: float = 1.0,
                         kernel=paged_prefill_attention, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill counterpart of ``check_decode_window``; sequence s's first query sits at ``ctx - q_len``."""
    (k_cache, v_cache), scales, kernel_table, table = _window_case(
        ctx_lens, [c - n for c, n in zip(ctx_lens, q_lens)], num_kv_heads, head_dim, page, dtype, device, window,
        kv_dtype, stale)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().to(device)
    q = (q_gain * torch.randn(sum(q_lens), num_heads, head_dim, device=device)).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    with _watching(kernel_table, table, stale) as table_reads:
        kernel(q, k_cache, v_cache, kernel_table, qsl, lens, max(q_lens), scale, out=out, window=window,
               softcap=softcap, **scales, **_sinks(sinks))
    assert table_reads[0] > 0, "no block-table load was seen"
    up = (lambda t: t) if kv_dtype else (lambda t: t.double())
    ref = paged_prefill_attention_ref(q.double(), up(k_cache), up(v_cache), table, qsl, lens, max(q_lens), scale,
                                      window=window, softcap=softcap, **scales, **_sinks(sinks, torch.float64))
    assert_close(out, ref, dtype, f"prefill window={window} softcap={softcap} {kv_dtype or ''}"
                 f"{' sinks' if sinks is not None else ''}")
    return out


def _sinks(sinks: torch.Tensor | None, dtype: torch.dtype | None = None) -> dict:
    """The ``sinks`` keyword (in ``dtype`` for the reference) when there are sinks; without, none, as before them."""
    return {} if sinks is None else {"sinks": sinks if dtype is None else sinks.to(dtype)}
