"""The Hopper decode kernels' fused merge in Gluon: ``decode_merge.merge_if_last`` (the Triton kernel's, which
is its reference; the memory order is explained there) for the 16-bit and 8-bit kernels.

It runs in the kernel's body after the warp-specialized region, on the consumer's warpgroup, the threads that
stored the split's partial: a CTA barrier there is the default warpgroup's named barrier, which the compiler
makes of every barrier outside the partitions, so the copy warp (parked) never takes part. Empty splits return
before it without storing or counting. The merging program reads each query head's live partials ``CHUNK`` at a
time, one warp a partial row (16-byte loads), the heads unrolled so their loads overlap.
"""

from __future__ import annotations

from .decode_merge import MERGE_CHUNK
from .gluon_sm90 import gluon

if gluon is not None:
    from .gluon_sm90 import gl, partition_barrier

    _CHUNK = gl.constexpr(MERGE_CHUNK)

    @gluon.jit
    def merge_if_last(MID_O, MID_LSE, O, CNT, b, kvh, n_live, num_splits, stride_ob, stride_oh,
                      GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
        """Count this live split of (sequence ``b``, KV head ``kvh``) in; the last of the ``n_live`` merges the
        group's partials ([B, Hq, num_splits, D] and [B, Hq, num_splits]) into ``O`` and puts the counter back to
        zero. Running max and denominator are kept as [CHUNK] vectors of equal values (loop-carried values with a
        layout, no scalar initialisers)."""
        num_kv_heads = gl.num_programs(0)
        counter = CNT + b * num_kv_heads + kvh
        partition_barrier()  # every thread's partial stores come before the release below
        done = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == n_live - 1:
            partition_barrier()  # no thread loads a partial before the acquire
            blk: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])  # [CHUNK, HEAD_DIM]
            split_layout: gl.constexpr = gl.SliceLayout(1, blk)
            dim_layout: gl.constexpr = gl.SliceLayout(0, blk)
            dims = gl.arange(0, HEAD_DIM, layout=dim_layout)
            rows = gl.arange(0, _CHUNK, layout=split_layout)
            for g in gl.static_range(GROUP):
                h = kvh * GROUP + g
                base = (b * (GROUP * num_kv_heads) + h).to(gl.int64) * num_splits
                m = gl.full([_CHUNK], float("-inf"), gl.float32, split_layout)
                total = gl.zeros([_CHUNK], gl.float32, split_layout)
                acc = gl.zeros([HEAD_DIM], gl.float32, dim_layout)
                for s0 in range(0, n_live, _CHUNK):
                    idx = s0 + rows
                    valid = idx < n_live
                    lse = gl.load(MID_LSE + base + idx, mask=valid, other=float("-inf"), cache_modifier=".cg")
                    m_new = gl.maximum(m, gl.max(lse, axis=0))
                    alpha = gl.exp2(m - m_new)
                    w = gl.exp2(lse - m_new)
                    part_ptr = MID_O + gl.expand_dims((base + idx) * HEAD_DIM, 1) + gl.expand_dims(dims, 0)
                    parts = gl.load(part_ptr, mask=gl.expand_dims(valid, 1), other=0.0, cache_modifier=".cg")
                    acc = acc * gl.max(alpha, axis=0) + gl.sum(parts * gl.expand_dims(w, 1), axis=0)
                    total = total * alpha + gl.sum(w, axis=0)
                    m = m_new
                out = acc / gl.max(total, axis=0)
                gl.store(O + b.to(gl.int64) * stride_ob + h * stride_oh + dims, out.to(O.dtype.element_ty))
            gl.atomic_add(counter, -n_live, sem="relaxed", scope="gpu")  # zero again: every live split has counted
