"""Merging split-K decode partials: the split kernels' partial buffers, the merge kernel of the two-launch path,
and the merge the split kernels run themselves (one launch).

A split program of (sequence, KV head) writes, for each query head of its group, a normalised partial output
``[B, Hq, num_splits, D]`` and its log2-sum-exp2 ``[B, Hq, num_splits]`` (float32). Two ways to merge them:

- **Fused (the default)**: after writing its partial, each split program adds 1 to its (sequence, KV head)
  counter; the program that sees the count reach the number of live splits merges the group's partials and
  writes the output. At batch 1 the separate merge launch cost about as much as the attention of a short
  context (H200, one layer: split kernel 4.2 us, merge kernel 3.9 us).
- **Two launches** (``MINFER_DECODE_FUSED_MERGE=0``, or ``fused_merge=False``): the merge kernel below, one
  program per (sequence, query head). The reference for the fused path, and the fallback.

Memory order of the fused path: every thread's partial stores, then a CTA barrier, then one thread's
``atomic_add`` with acq_rel semantics at GPU scope: the barrier puts the other threads' stores before the
release, so the last program's acquire sees every split's partial (the split-K semaphore pattern). The merging
program meets at a barrier after its acquire before any thread loads a partial, and loads them with ``.cg``
(from L2, never a stale L1 line). Empty splits (a sequence shorter than the splits) write nothing and do not
count: the target is the number of live splits, computed from the sequence's own length as the ranges are cut.

Counters: ``[B * Hkv]`` int32, zero between launches: allocated zeroed once per device (``split_counters``) and
put back to zero by the program that merged (it subtracts the count), so no memset runs per step and a CUDA
graph replays with the same buffer. One buffer per device: launches on one device must not overlap in time
(one stream, as the engine runs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..pdl import launch_options, use_pdl, wait_for_previous

MAX_SPLITS = 256
MERGE_CHUNK = 16  # partials a merge reads at once: registers bounded for any split count
MIN_COUNTERS = 4096  # the first buffer's counters: every split the heuristic picks fits (B * Hkv < 2 per SM)
_counters: dict[torch.device, list[torch.Tensor]] = {}


def fused_merge_enabled(fused: bool | None = None) -> bool:
    """``fused`` if given, else ``MINFER_DECODE_FUSED_MERGE`` (unset or ``1``: fused; ``0``: two launches)."""
    if fused is not None:
        return fused
    return os.environ.get("MINFER_DECODE_FUSED_MERGE", "1") != "0"


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least ``n`` counters on ``device``, kept for the process (a captured graph may
    hold it), or None where a larger one would have to be allocated during CUDA graph capture (the caller takes
    the two-launch path)."""
    bufs = _counters.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        bufs.append(torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device))
    return bufs[-1]


def split_partials(q: torch.Tensor, out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernels' partial outputs ``[B, Hq, num_splits, D]`` and log2-sum-exp2 ``[B, Hq, num_splits]``
    (float32), after checking ``num_splits``; with one split the kernel writes ``out`` directly (both are ``out``,
    unused)."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if num_splits == 1:
        return out, out
    batch, num_heads, head_dim = q.shape
    return (torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device),
            torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device))


@triton.jit
def merge_head(MID_O, MID_LSE, base, n, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """The merged output [HEAD_DIM] of the ``n`` partials at rows ``base + [0, n)``: one online pass, CHUNK
    partials at a time. An empty split's -inf lse weighs 0; the first split always holds a key, so the running
    max is finite after the first chunk."""
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, n, CHUNK):
        idx = s0 + tl.arange(0, CHUNK)
        valid = idx < n
        lse = tl.load(MID_LSE + base + idx, mask=valid, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        parts = tl.load(MID_O + (base + idx)[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0,
                        cache_modifier=".cg")
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    return acc / total


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    MID_O, MID_LSE, O, stride_ob, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    out = merge_head(MID_O, MID_LSE, (b * num_heads + h).to(tl.int64) * num_splits, num_splits, HEAD_DIM, CHUNK)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + tl.arange(0, HEAD_DIM), out.to(O.dtype.element_ty))


def merge_partials(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge the splits' partials (``split_partials``) into ``out`` ``[B, Hq, D]`` (the two-launch path)."""
    batch, num_heads, num_splits, head_dim = mid_o.shape
    pdl = use_pdl(out.device)
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, CHUNK=MERGE_CHUNK, PDL=pdl, num_warps=4, **launch_options(pdl),
    )


@triton.jit
def merge_if_last(MID_O, MID_LSE, O, CNT, b, kvh, n_live, num_splits, stride_ob, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """The fused merge's tail, run by every live split program of (sequence ``b``, KV head ``kvh``) once its
    partials are stored: count this split in; the last of the ``n_live`` merges the group's heads into ``O`` and
    puts the counter back to zero for the next launch."""
    num_kv_heads = tl.num_programs(0)
    counter = CNT + b * num_kv_heads + kvh
    tl.debug_barrier()  # every thread's partial stores come before the release below
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == n_live - 1:
        tl.debug_barrier()  # no thread loads a partial before the acquire
        dims = tl.arange(0, HEAD_DIM)
        for g in tl.static_range(GROUP):
            h = kvh * GROUP + g
            base = (b * (GROUP * num_kv_heads) + h).to(tl.int64) * num_splits
            out = merge_head(MID_O, MID_LSE, base, n_live, HEAD_DIM, CHUNK)
            tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + dims, out.to(O.dtype.element_ty))
        tl.atomic_add(counter, -n_live, sem="relaxed", scope="gpu")  # zero again: every live split has counted
