"""What the Hopper (sm_90) attention kernels in Gluon share: the Gluon imports and the names that moved
between Tritons, when the kernels apply, the build-once guard, and the device functions both kernels run:
the copy warp's per-page TMA copies and the converter partition that turns 8-bit codes into float16 tiles, the
decode kernels' split ranges, and the three score options every kernel takes:

- **Sliding windows** (``WINDOW``, a compile-time int, 0 = none): a query at position p sees keys k with
  ``p - WINDOW < k <= p``. A kernel's key loop starts at the TMA copy (a page, or a 64/128-key part of a larger
  one) that holds the first key any of its queries sees, never earlier: a hybrid KV cache frees the blocks
  behind every window, and their block-table entries may be stale or -1. Keys of that copy before the window
  are masked by position, as keys past the context are.
- **Soft-capping** (``SOFTCAP``, a compile-time float, 0 = none; Gemma 2): the scaled score s becomes
  ``SOFTCAP * tanh(s / SOFTCAP)`` before masking and softmax. The kernels work in the log2 domain, so the
  host passes the score scale of ``soft_cap`` (``score_scale``) and the cap returns log2-domain scores.
- **Sinks** (``HAS_SINKS``, with ``SINKS`` ``[Hq]``, None without; gpt-oss): a logit per query head in the softmax's
  denominator, with no value. A row's running max starts at its head's sink (``running_max_start``; a decode's split
  0 alone: the merge weighs it in once), and the sink's term joins the denominator at the end (``add_sink``).

All three are compile-time so that a kernel without them compiles to the code it had before they existed.

Gluon (``triton.experimental.gluon``, Triton >= 3.5) exposes what Triton's compiler does not do by itself:
warp specialization, TMA bulk copies completing on mbarriers, warpgroup MMA. It has no interpreter, so the
Triton kernels stay the reference and the path everywhere else (``prefill_attention.py``,
``decode_attention.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernels serve every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 (re-exported to the kernels)
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.language._core import shared_memory_descriptor
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
except ImportError:  # pragma: no cover - exercised only with an old Triton
    gluon = None

logger = logging.getLogger("minfer")

LOG2E = 1.4426950408889634
HALF = 64  # columns of a tile half: a 128-byte swizzled row of 16-bit values (64 bytes of 8-bit codes)
MEASURED_TRITON = ("3.6.",)  # where the kernels were timed and tested on an H200 (benchmarks/RESULTS.md)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index) == (9, 0)


def sm90_available(device: torch.device, head_dim: int, block_size: int) -> bool:
    """Whether the Hopper kernels serve ``device``: a Hopper GPU, Gluon present, head_dim 64 or 128, pages of at
    least 16 tokens (a TMA copy per page; smaller pages would cut swizzle atoms). ``MINFER_SM90_ATTENTION``:
    unset, only on the Triton versions they were measured on (``MEASURED_TRITON``: another Triton compiles them
    differently, e.g. 3.9 spills registers in the prefill kernel); ``1``, on any Triton with Gluon; ``0``, never."""
    mode = os.environ.get("MINFER_SM90_ATTENTION", "")
    if gluon is None or device.type != "cuda" or mode == "0":
        return False
    if mode != "1" and not triton.__version__.startswith(MEASURED_TRITON):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capable(index) and head_dim in (64, 128) and block_size >= 16 and block_size & (block_size - 1) == 0


def score_scale(scale: float, softcap: float) -> float:
    """The factor the kernels multiply q·k by (their ``scale_log2e`` argument): ``scale * log2 e``, the
    log2-domain score, or with a cap ``scale * 2 log2 e / softcap``, the exponent ``soft_cap`` expects."""
    return scale * 2 * LOG2E / softcap if softcap else scale * LOG2E


Kind = bool | tuple[bool, bool, bool, bool]


def build_kind(quant: bool, window: int, softcap: float, sinks: bool = False) -> Kind:
    """What a ``BuildGuard`` keeps apart: whether the cache is 8-bit, and for a variant with a window, a cap or
    sinks, ``(8-bit, windowed, capped, sinks)`` (each compiles its own code, so each may fail to build on its own)."""
    return (quant, window > 0, softcap > 0, sinks) if window or softcap or sinks else quant


class BuildGuard:
    """Launches a Gluon kernel, and on the first launch of each kind (``build_kind``: the kernels compile
    different code for 8-bit caches, windows, caps and sinks) catches a build failure: Gluon is experimental and its
    API moves between Tritons, so a kernel that does not build logs one warning and the caller's Triton kernel
    serves that kind from then on."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.launched: set[Kind] = set()
        self.failed: set[Kind] = set()

    def launch(self, kind: Kind, run: Callable[[], None]) -> bool:
        """Run ``run`` (the launch); False if this kind does not build here (the caller falls back)."""
        if kind in self.launched:
            run()
            return True
        if kind in self.failed:
            return False
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - any compile failure: keep serving on the Triton kernel
            self.failed.add(kind)
            quant, windowed, capped, sinks = kind if isinstance(kind, tuple) else (kind, False, False, False)
            variant = "8-bit" if quant else "16-bit"
            variant += " caches" + ", a window" * windowed + ", soft-capping" * capped + ", sinks" * sinks
            logger.warning("the Hopper %s kernel (%s) failed to build on Triton %s; using the Triton kernel "
                           "instead: %s: %s", self.what, variant, triton.__version__, type(exc).__name__,
                           str(exc)[:300])
            return False
        self.launched.add(kind)
        return True


if gluon is not None:
    # Names that moved between Tritons: the TMA load (3.6: async_copy_global_to_shared; in 3.9 that name
    # raises), the shared-memory view as another dtype, the thread barrier.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _NEW_REINTERPRET = gl.constexpr(hasattr(shared_memory_descriptor, "reinterpret"))
    partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # a partition's warps meet (3.9: barrier)
    _HALF = gl.constexpr(HALF)
    _LOG2E = gl.constexpr(LOG2E)

    @gluon.jit
    def soft_cap(x, SOFTCAP: gl.constexpr):
        """The capped score in the log2 domain, from ``x`` = 2 log2 e · s / SOFTCAP (s the scaled score, the
        product by ``score_scale``): SOFTCAP · tanh(s / SOFTCAP) · log2 e = c - 2c / (2^x + 1), c = SOFTCAP · log2 e.
        Within a few float32 ulps of c for any x (2^x = inf gives c, 0 gives -c), where ``tanh.approx``'s 2^-11
        relative error would move a score by up to 0.02 at a cap of 50 (2% of its probability); one exp2 and one
        division per score."""
        c: gl.constexpr = SOFTCAP * _LOG2E
        return c - (2.0 * c) / (gl.exp2(x) + 1.0)

    @gluon.jit
    def log2_scores(s, scale, SOFTCAP: gl.constexpr):
        """Raw products ``s`` times ``scale`` (``score_scale``, per key too for 8-bit caches) as log2-domain
        scores, capped if ``SOFTCAP``."""
        x = s * scale
        if SOFTCAP > 0:
            x = soft_cap(x, SOFTCAP)
        return x

    @gluon.jit
    def head_sinks(SINKS, heads, keep):
        """The sinks of ``heads`` (where ``keep``; 0 elsewhere) in the log2 domain, as float32."""
        return gl.load(SINKS + heads, mask=keep, other=0.0).to(gl.float32) * _LOG2E

    @gluon.jit
    def running_max_start(sink, start, HAS_SINKS: gl.constexpr):
        """Where a running max starts: ``start`` (-inf, or a finite floor where a row may see no key of a tile),
        raised to the row's ``sink`` with sinks (which is -inf where a split counts none)."""
        if HAS_SINKS:
            start = gl.maximum(start, sink)
        return start

    @gluon.jit
    def add_sink(l_i, m_i, sink, HAS_SINKS: gl.constexpr):
        """The denominator ``l_i`` with the sink's term, exp2(sink - m_i), at most 1 (m_i started at the sink): 0 for
        a -inf sink, so a split that counts none adds nothing."""
        if HAS_SINKS:
            l_i = l_i + gl.exp2(sink - m_i)
        return l_i

    @gluon.jit
    def issue_tile(k_desc, v_desc, k_smem, v_smem, bar, bt_row, slot, n0, end, kv_col,
                   PAGE: gl.constexpr, HALVES: gl.constexpr, BLOCK_N: gl.constexpr):
        """Start the TMA copies of the key tile at position ``n0`` (K and V, every page and half) into ring
        ``slot``, completing on ``bar``. ``n0`` is a multiple of a copy's rows, so each copy lies in one page (a
        window's tiles start at such a copy, not at a tile boundary). Table entries at or past ``end`` are not
        read: page 0 stands in (masked by position)."""
        ROWS: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N  # rows per copy
        COPIES: gl.constexpr = BLOCK_N // ROWS
        mbarrier.expect(bar, 2 * BLOCK_N * HALVES * _HALF * k_desc.dtype.primitive_bitwidth // 8)
        for c in gl.static_range(COPIES):
            pos = n0 + c * ROWS
            page = gl.load(bt_row + pos // PAGE, mask=pos < end, other=0)
            row = page * PAGE + pos % PAGE
            for hf in gl.static_range(HALVES):
                col = kv_col + hf * _HALF
                _tma_load(k_desc, [row, col], bar, k_smem.index(slot * HALVES + hf).slice(c * ROWS, ROWS))
                _tma_load(v_desc, [row, col], bar, v_smem.index(slot * HALVES + hf).slice(c * ROWS, ROWS))

    @gluon.jit
    def codes_to_f16(x):
        """8-bit codes → the float16 values they encode, exactly. int8 by byte permutes: code + 128 becomes
        the low byte of the float16 1024 + (code + 128), and one packed subtraction of 1152 leaves the code
        (integer-to-float conversions issue at a quarter of the ALU rate; these at full rate). fp8 by the
        hardware's conversion."""
        if x.dtype == gl.int8:
            return gl.inline_asm_elementwise(
                "{ .reg .b32 u, a, b, c; mov.b32 c, 0x64806480; xor.b32 u, $2, 0x80808080; "
                "prmt.b32 a, u, 0x64646464, 0x4140; prmt.b32 b, u, 0x64646464, 0x4342; "
                "sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
                "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
        return x.to(gl.float16)

    @gluon.jit
    def converter(kc_smem, vc_smem, k16, v16, sc_smem, ready, codes_empty, conv_ready, conv_empty, KS, VS,
                  bt_row, s_base, s_stride, n_start, end, n_tiles, scale_log2e, PAGE: gl.constexpr,
                  HALVES: gl.constexpr, CODE_STAGES: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                  CHUNK: gl.constexpr):
        """8-bit caches: the warps (4) that turn each tile's codes into the float16 values they encode (exact),
        in shared memory for the MMAs, and stage its per-key scales (K's with ``scale_log2e`` folded in); they
        run beside the consumers' products. Tile t holds keys ``n_start + t * BLOCK_N`` on. ``CHUNK`` rows at a
        time: more bytes in flight per load, as the register budget allows."""
        blk: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [32, 64] codes, 16 a thread
        key_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        for t in range(n_tiles):
            cs = t % CODE_STAGES
            cv = t % STAGES
            offs = n_start + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_layout)
            valid = offs < end
            page = gl.load(bt_row + offs // PAGE, mask=valid, other=0).to(gl.int64)
            s_off = s_base + page * s_stride + offs % PAGE
            k_sc = gl.load(KS + s_off, mask=valid, other=0.0).to(gl.float32) * scale_log2e
            v_sc = gl.load(VS + s_off, mask=valid, other=0.0).to(gl.float32)
            mbarrier.wait(ready.index(cs), (t // CODE_STAGES) & 1)
            mbarrier.wait(conv_empty.index(cv), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)
            for hf in gl.static_range(HALVES):
                for r in gl.static_range(BLOCK_N // CHUNK):
                    x = kc_smem.index(cs * HALVES + hf).slice(r * CHUNK, CHUNK).load(blk)
                    k16.index(cv * HALVES + hf).slice(r * CHUNK, CHUNK).store(codes_to_f16(x))
                    y = vc_smem.index(cs * HALVES + hf).slice(r * CHUNK, CHUNK).load(blk)
                    v16.index(cv * HALVES + hf).slice(r * CHUNK, CHUNK).store(codes_to_f16(y))
            sc_smem.index(2 * cv).store(k_sc)
            sc_smem.index(2 * cv + 1).store(v_sc)
            fence_async_shared()  # the MMAs read these stores through the async proxy
            partition_barrier()  # every converter warp is done before one thread signals
            mbarrier.arrive(codes_empty.index(cs), count=1)
            mbarrier.arrive(conv_ready.index(cv), count=1)

    @gluon.jit
    def barrier_ring(STAGES: gl.constexpr, RELEASES: gl.constexpr):
        """A ring's mbarriers, initialised: ``ready`` (one arrival: the copy warp's expected bytes) and ``empty``
        (``RELEASES`` arrivals: the partitions that read a slot) per slot."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=RELEASES)
        return ready, empty

    @gluon.jit
    def invalidate_ring(ready, empty, STAGES: gl.constexpr):
        """The end of a ``barrier_ring``'s use."""
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

    @gluon.jit
    def code_ring(k_desc, CODE_STAGES: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr,
                  BLOCK_N: gl.constexpr):
        """8-bit caches: the shared memory the copy warp and the converter add (K and V code slots in the
        descriptors' layout, the staged per-key scales of the ``STAGES`` float16 slots) and the code slots'
        ``copied`` / ``released`` mbarriers, initialised."""
        kc_smem = gl.allocate_shared_memory(k_desc.dtype, [CODE_STAGES * HALVES, BLOCK_N, _HALF], k_desc.layout)
        vc_smem = gl.allocate_shared_memory(k_desc.dtype, [CODE_STAGES * HALVES, BLOCK_N, _HALF], k_desc.layout)
        sc_smem = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BLOCK_N],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        copied, released = barrier_ring(CODE_STAGES, 1)
        return kc_smem, vc_smem, sc_smem, copied, released

    @gluon.jit
    def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """The same shared memory viewed as ``dtype`` of ``shape`` in ``layout``: ``reinterpret`` since Triton
        3.9, ``_reinterpret`` before."""
        if _NEW_REINTERPRET:
            view = smem.reinterpret(dtype, shape, layout)
        else:
            view = smem._reinterpret(dtype, shape, layout)
        return view

    # ------------------------------------------------------------------ what the two decode kernels share
    @gluon.jit
    def split_range(CL, b, split, num_splits, BLOCK_N: gl.constexpr, ROWS: gl.constexpr, WINDOW: gl.constexpr):
        """Keys [start, end) of split ``split`` of sequence ``b``, and ``lo``, the first key its query sees:
        equal ranges of the keys read, rounded up to whole tiles (as the Triton kernel cuts them). Without a
        window they cover the context; with one, [lo, ctx) with lo = max(0, ctx - WINDOW), its start rounded down
        to a copy's ``ROWS`` keys (within lo's page: the TMA copies start there), so no split reads a table entry
        of a page the window has left, and windowed decode costs O(WINDOW) at any context length."""
        ctx = gl.load(CL + b)
        if WINDOW > 0:
            lo = gl.maximum(ctx - WINDOW, 0)
            first = lo // ROWS * ROWS
            per_split = gl.cdiv(gl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N
            start = first + split * per_split
        else:
            lo = 0
            per_split = gl.cdiv(gl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
            start = split * per_split
        return start, gl.minimum(start + per_split, ctx), lo

    @gluon.jit
    def online_softmax(s, m_i, l_keys, n0, lo, end, key_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                       WINDOW: gl.constexpr):
        """One Sᵀ tile [keys, heads] (scaled to the log2 domain) of the online softmax, per column: (Pᵀ, the new
        running max per head, the per-(key, head) denominators, the factor rescaling the output). Keys at or
        past ``end`` are masked, and with a ``WINDOW`` those before ``lo`` (the heads of a decode share one
        query position, so a split's first tile still holds a key every column sees)."""
        offs = n0 + gl.arange(0, BLOCK_N, layout=key_layout)
        keep = offs < end
        if WINDOW > 0:
            keep = keep & (offs >= lo)
        s = gl.where(gl.expand_dims(keep, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_keys * gl.expand_dims(alpha, 0) + p, alpha

    @gluon.jit
    def decode_max_start(SINKS, kvh, split, head_layout: gl.constexpr, GROUP: gl.constexpr, NPAD: gl.constexpr,
                         HAS_SINKS: gl.constexpr):
        """(a decode split's running max at its start per head, the heads' sinks as the split counts them): -inf, and
        with sinks split 0 counts them (the other splits -inf), so the merge weighs each in once."""
        m_i = gl.full([NPAD], float("-inf"), gl.float32, head_layout)
        sink = m_i
        if HAS_SINKS:
            n = gl.arange(0, NPAD, layout=head_layout)
            sink = gl.where(split == 0, head_sinks(SINKS, kvh * GROUP + n, n < GROUP), float("-inf"))
        return running_max_start(sink, m_i, HAS_SINKS), sink

    @gluon.jit
    def write_decode_output(o0, o1, d0, d1, m_i, l_keys, sink, O, MID_O, MID_LSE, b, kvh, split, num_splits,
                            stride_ob, stride_oh, head_layout: gl.constexpr, GROUP: gl.constexpr, NPAD: gl.constexpr,
                            HEAD_DIM: gl.constexpr, TWO: gl.constexpr, DIRECT: gl.constexpr,
                            HAS_SINKS: gl.constexpr):
        """A decode program's result from Oᵀ's accumulators ``o0`` (and ``o1`` if ``TWO``), whose rows hold head dims
        ``d0`` (``d1``) [rows, 1]: the output (``DIRECT``), or the split's normalised partial [B, Hq, num_splits, D]
        and log2-sum-exp2 [B, Hq, num_splits], as the Triton kernel writes them for its merge; the denominator with
        the ``sink`` the split counts (``decode_max_start``)."""
        l_i = add_sink(gl.sum(l_keys, axis=0), m_i, sink, HAS_SINKS)  # > 0: every split holds a key
        inv_l = gl.expand_dims(1.0 / l_i, 0)
        n = gl.arange(0, NPAD, layout=head_layout)
        heads = kvh * GROUP + n
        keep = gl.expand_dims(n < GROUP, 0)
        if DIRECT:
            base = O + b.to(gl.int64) * stride_ob + gl.expand_dims(heads * stride_oh, 0)
            gl.store(base + d0, (o0 * inv_l).to(O.dtype.element_ty), mask=keep)
            if TWO:
                gl.store(base + d1, (o1 * inv_l).to(O.dtype.element_ty), mask=keep)
        else:
            idx = (b * (GROUP * gl.num_programs(0)) + heads).to(gl.int64) * num_splits + split
            base = MID_O + gl.expand_dims(idx * HEAD_DIM, 0)
            gl.store(base + d0, o0 * inv_l, mask=keep)
            if TWO:
                gl.store(base + d1, o1 * inv_l, mask=keep)
            gl.store(MID_LSE + idx, m_i + gl.log2(l_i), mask=n < GROUP)

    @gluon.jit
    def write_empty_split(MID_O, MID_LSE, b, kvh, split, num_splits, GROUP: gl.constexpr, NPAD: gl.constexpr,
                          HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
        """An empty split (a sequence shorter than the splits): a zero partial whose -inf lse the merge ignores."""
        blk: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
        n = gl.arange(0, NPAD, layout=gl.SliceLayout(1, blk))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
        idx = (b * (GROUP * gl.num_programs(0)) + kvh * GROUP + n).to(gl.int64) * num_splits + split
        gl.store(MID_O + gl.expand_dims(idx * HEAD_DIM, 1) + gl.expand_dims(d, 0),
                 gl.zeros([NPAD, HEAD_DIM], gl.float32, blk), mask=gl.expand_dims(n < GROUP, 1))
        gl.store(MID_LSE + idx, gl.full([NPAD], float("-inf"), gl.float32, gl.SliceLayout(1, blk)), mask=n < GROUP)
