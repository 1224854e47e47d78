"""Experimental int8-cache decode kernels (issue 7): SASS counts here, GPU timings on the device.

Variants of the split kernel's loop for an int8 cache (constexpr switches):
  QK8  — Q·Kᵀ as an int8 × int8 MMA (q quantized per row in the kernel), no K conversion at all.
  VF16 — V codes → float16 by the 0x6480 byte trick (1152 + code) and P·V in float16, corrected
         by the row sums of P (instead of Triton's int8 → bf16 conversion).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_to_f16_asm(x):
    """int8 codes → float16 in registers: xor + two byte permutes make ``1152 + code`` exactly, one
    float16 subtraction per pair removes the 1152 (exact). Subtracting after the MMA instead (a row
    sum of P) loses ~2.5e-2 on Hopper: the tensor cores' float32 accumulation does not keep the
    low bits of ``1152 * sum(P)`` against which the result is a small difference.

    Inline PTX is opaque to Triton, so the conversion stays where it is written: on the loaded tile,
    before the tile's layout is changed for the MMA (so V is transposed as float16, by ldmatrix,
    rather than gathered byte by byte)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 u, a, b, c; mov.b32 c, 0x64806480; xor.b32 u, $2, 0x80808080; "
        "prmt.b32 a, u, 0x64646464, 0x4140; prmt.b32 b, u, 0x64646464, 0x4342; "
        "sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def fp8_to_f16_asm(x, KIND: tl.constexpr, PURE: tl.constexpr = False):
    """fp8 codes → float16 in registers: e4m3 by the native sm_89+ cvt, e5m2 (the top byte of a
    float16) by a byte permute. Impure (opaque) for V like ``int8_to_f16_asm``; pure for K, whose
    conversion Triton may then move after the shared-memory load (K-major 8-bit tiles load fine)."""
    if KIND == 1:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)
    else:
        return tl.inline_asm_elementwise(
            "{ prmt.b32 $0, 0, $2, 0x5040; prmt.b32 $1, 0, $2, 0x7060; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def q8_split_kernel(
    Q, K, V, KS, VS, BT, CL, MID_O, MID_LSE, scale_log2e,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
    num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, QK8: tl.constexpr, VF16: tl.constexpr, VASM: tl.constexpr = False,
    PRE: tl.constexpr = False, QLO: tl.constexpr = False, LACC: tl.constexpr = False, KIND: tl.constexpr = 0, DIRECT: tl.constexpr = False,
    O=None, stride_ob=0, stride_oh=0,
):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CL + b)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    rows = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(tl.float32)
    if QK8:
        q_amax = tl.max(tl.abs(q), axis=1)
        q_scale = tl.where(q_amax > 0, q_amax / 127.0, 1.0)
        qc = q / q_scale[:, None]
        q8 = (qc + tl.where(qc >= 0, 0.5, -0.5)).to(tl.int8)
        row_scale = q_scale * scale_log2e
        if QLO:  # q ≈ q_scale * (q8 + q_lo / 256): two int8 MMAs give ~15 bits of q
            r = tl.minimum(tl.maximum((qc - q8.to(tl.float32)) * 256.0, -127.0), 127.0)
            q_lo = (r + tl.where(r >= 0, 0.5, -0.5)).to(tl.int8)
            row_scale = row_scale / 256.0
    elif KIND != 0:
        qb = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    else:
        qb = q.to(tl.bfloat16)
    if VF16 and not VASM and KIND == 0:
        v_bias = tl.zeros([GROUP_PAD], tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if LACC:  # the softmax denominators per (row, column), summed over columns once at the end
        l_acc = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    kv_base = kvh.to(tl.int64) * stride_kh
    s_head = kvh * PAGE
    s_page = tl.num_programs(0) * PAGE
    if PRE:  # the first tile's scales; each iteration then loads the next tile's
        offs = start + tl.arange(0, BLOCK_N)
        valid = offs < end
        page0 = tl.load(bt_row + offs // PAGE, mask=valid, other=0)
        s_off = page0.to(tl.int64) * s_page + s_head + offs % PAGE
        ks_next = tl.load(KS + s_off, mask=valid, other=0.0)
        vs_next = tl.load(VS + s_off, mask=valid, other=0.0)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        page = tl.load(bt_row + offs // PAGE, mask=valid, other=0).to(tl.int64)
        tok = kv_base + page * stride_kb + (offs % PAGE) * stride_kt
        k = tl.load(K + tok[:, None] + dims[None, :], mask=valid[:, None], other=0)
        v = tl.load(V + tok[:, None] + dims[None, :], mask=valid[:, None], other=0)
        if PRE:
            k_scale = ks_next.to(tl.float32)
            v_scale = vs_next.to(tl.float32)
            offs_n = offs + BLOCK_N
            valid_n = offs_n < end
            page_n = tl.load(bt_row + offs_n // PAGE, mask=valid_n, other=0)
            s_off = page_n.to(tl.int64) * s_page + s_head + offs_n % PAGE
            ks_next = tl.load(KS + s_off, mask=valid_n, other=0.0)
            vs_next = tl.load(VS + s_off, mask=valid_n, other=0.0)
        else:
            s_off = page * s_page + s_head + offs % PAGE
            k_scale = tl.load(KS + s_off, mask=valid, other=0.0).to(tl.float32)
            v_scale = tl.load(VS + s_off, mask=valid, other=0.0).to(tl.float32)
        if QK8:
            if QLO:
                s = ( tl.dot(q8, tl.trans(k), out_dtype=tl.int32) * 256
                     + tl.dot(q_lo, tl.trans(k), out_dtype=tl.int32)).to(tl.float32)
            else:
                s = tl.dot(q8, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
            s = s * row_scale[:, None] * k_scale[None, :]
        elif KIND != 0:
            s = tl.dot(qb, tl.trans(fp8_to_f16_asm(k, KIND, True))) * (k_scale * scale_log2e)[None, :]
        else:
            s = tl.dot(qb, tl.trans(k.to(tl.bfloat16))) * (k_scale * scale_log2e)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        if LACC:
            l_acc = l_acc * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        if KIND != 0:
            pv = (p * v_scale[None, :]).to(tl.float16)
            acc = tl.dot(pv, fp8_to_f16_asm(v, KIND), acc * alpha[:, None])
        elif VF16 and VASM:
            pv = (p * v_scale[None, :]).to(tl.float16)
            acc = tl.dot(pv, int8_to_f16_asm(v), acc * alpha[:, None])
        elif VF16:
            pv = (p * v_scale[None, :]).to(tl.float16)
            if VASM:
                vf = int8_to_f16_asm(v)
            else:
                vf = (v.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480).to(tl.float16, bitcast=True)
            acc = tl.dot(pv, vf, acc * alpha[:, None])
            v_bias = v_bias * alpha + tl.sum(pv.to(tl.float32), axis=1)
        else:
            pv = (p * v_scale[None, :]).to(tl.bfloat16)
            acc = tl.dot(pv, v.to(tl.bfloat16), acc * alpha[:, None])
        m_i = m_new
    if LACC:
        l_i = tl.sum(l_acc, axis=1)
    if VF16 and not VASM and KIND == 0:
        acc -= 1152.0 * v_bias[:, None]

    if DIRECT:
        tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 (acc / l_i[:, None]).to(O.dtype.element_ty), mask=row_mask[:, None])
        return
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    idx = (b * (GROUP * tl.num_programs(0)) + heads).to(tl.int64) * num_splits + split
    tl.store(MID_O + idx[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask[:, None])
    tl.store(MID_LSE + idx, lse, mask=row_mask)


SIG = {"Q": "*bf16", "K": "*i8", "V": "*i8", "KS": "*fp16", "VS": "*fp16", "BT": "*i32", "CL": "*i32",
       "MID_O": "*fp32", "MID_LSE": "*fp32", "scale_log2e": "fp32", "stride_qb": "i32", "stride_qh": "i32",
       "stride_kb": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_btb": "i32", "num_splits": "i32",
       "O": "*bf16", "stride_ob": "i32", "stride_oh": "i32"}


@triton.jit
def wb_split_kernel(
    Q, K, V, KS, VS, BT, CL, MID_O, MID_LSE, scale_log2e,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
    num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, W: tl.constexpr, KIND: tl.constexpr = 0, DIRECT: tl.constexpr = False,
    O=None, stride_ob=0, stride_oh=0,
):
    """Warp-batched int8/fp8 decode: each iteration takes W pages, one per warp, as a [W, PAGE, D]
    tile; the dots are batched over W, so a warp's scores, softmax and P·V never leave it (no
    barriers inside the loop); the W running states merge once at the end."""
    BLOCK_N: tl.constexpr = W * PAGE
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CL + b)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    rows = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0).to(tl.float32)
    if KIND == 0:
        q_amax = tl.max(tl.abs(q), axis=1)
        q_scale = tl.where(q_amax > 0, q_amax / 127.0, 1.0)
        qc = q / q_scale[:, None]
        q8 = (qc + tl.where(qc >= 0, 0.5, -0.5)).to(tl.int8)
        r = tl.minimum(tl.maximum((qc - q8.to(tl.float32)) * 256.0, -127.0), 127.0)
        q_lo = (r + tl.where(r >= 0, 0.5, -0.5)).to(tl.int8)
        row_scale = q_scale * scale_log2e / 256.0
        qa = tl.broadcast_to(q8[None, :, :], (W, GROUP_PAD, HEAD_DIM))
        qb = tl.broadcast_to(q_lo[None, :, :], (W, GROUP_PAD, HEAD_DIM))
    else:
        qa = tl.broadcast_to(tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)[None, :, :],
                             (W, GROUP_PAD, HEAD_DIM))

    m_i = tl.full([W, GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([W, GROUP_PAD], tl.float32)
    acc = tl.zeros([W, GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    kv_base = kvh.to(tl.int64) * stride_kh
    wi = tl.arange(0, W)
    ti = tl.arange(0, PAGE)
    s_head = kvh * PAGE
    s_page = tl.num_programs(0) * PAGE
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + wi[:, None] * PAGE + ti[None, :]  # [W, PAGE]: warp w takes page n0 / PAGE + w
        valid = offs < end
        pages = tl.load(bt_row + n0 // PAGE + wi, mask=n0 + wi * PAGE < end, other=0).to(tl.int64)
        tok = kv_base + pages[:, None] * stride_kb + ti[None, :] * stride_kt
        k = tl.load(K + tok[:, :, None] + dims[None, None, :], mask=valid[:, :, None], other=0)
        v = tl.load(V + tok[:, :, None] + dims[None, None, :], mask=valid[:, :, None], other=0)
        s_off = pages[:, None] * s_page + s_head + ti[None, :]
        k_scale = tl.load(KS + s_off, mask=valid, other=0.0).to(tl.float32)
        v_scale = tl.load(VS + s_off, mask=valid, other=0.0).to(tl.float32)
        kt = tl.trans(k, (0, 2, 1))
        if KIND == 0:
            s = (tl.dot(qa, kt, out_dtype=tl.int32) * 256 + tl.dot(qb, kt, out_dtype=tl.int32)).to(tl.float32)
            s = s * row_scale[None, :, None] * k_scale[:, None, :]
        else:
            s = tl.dot(qa, tl.trans(fp8_to_f16_asm(k, KIND, True), (0, 2, 1))) * (k_scale * scale_log2e)[:, None, :]
        s = tl.where(valid[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a warp whose page is past the end
        p = tl.exp2(s - m_safe[:, :, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=2)
        pv = (p * v_scale[:, None, :]).to(tl.float16)
        vf = int8_to_f16_asm(v) if KIND == 0 else fp8_to_f16_asm(v, KIND)
        acc = tl.dot(pv, vf, acc * alpha[:, :, None])
        m_i = m_new

    m = tl.max(m_i, axis=0)
    m_s = tl.where(m == float("-inf"), 0.0, m)
    wgt = tl.exp2(m_i - m_s[None, :])
    l_t = tl.sum(l_i * wgt, axis=0)
    acc_t = tl.sum(acc * wgt[:, :, None], axis=0)
    if DIRECT:
        tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 (acc_t / l_t[:, None]).to(O.dtype.element_ty), mask=row_mask[:, None])
        return
    nonempty = l_t > 0
    out = acc_t / tl.where(nonempty, l_t, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l_t, 1.0)), float("-inf"))
    idx = (b * (GROUP * tl.num_programs(0)) + heads).to(tl.int64) * num_splits + split
    tl.store(MID_O + idx[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask[:, None])
    tl.store(MID_LSE + idx, lse, mask=row_mask)


def run_variant(q, kq, vq, ks, vs, table, lens, scale, out, const: dict, warps: int, stages: int, splits: int):
    """One decode over an 8-bit cache with ``q8_split_kernel`` (+ the shipped merge when split)."""
    import torch
    from minfer.kernels.decode_attention import LOG2E, _decode_merge_kernel
    batch, hq, d = q.shape
    page, hkv = kq.shape[1], kq.shape[2]
    group = hq // hkv
    direct = splits == 1
    if direct:
        mid_o = mid_lse = out
    else:
        mid_o = torch.empty((batch, hq, splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, hq, splits), dtype=torch.float32, device=q.device)
    const = dict(const)
    if kq.dtype != torch.int8:  # fp8 codes go to the inline-asm conversions as raw bytes
        kq, vq = kq.view(torch.uint8), vq.view(torch.uint8)
    if "W" in const:
        const.pop("BLOCK_N", None)
    kern = (wb_split_kernel if "W" in const else q8_split_kernel)[(hkv, batch, splits)](
        q, kq, vq, ks, vs, table, lens, mid_o, mid_lse, scale * LOG2E, q.stride(0), q.stride(1), kq.stride(0),
        kq.stride(1), kq.stride(2), table.stride(0), splits, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, PAGE=page, DIRECT=direct, O=out, stride_ob=out.stride(0), stride_oh=out.stride(1),
        num_warps=warps, num_stages=stages, **const)
    if not direct:
        _decode_merge_kernel[(batch, hq)](mid_o, mid_lse, out, out.stride(0), out.stride(1), hq, splits, HEAD_DIM=d,
                                          CHUNK=16, num_warps=4)
    return kern


INT8_BEST = dict(QK8=True, VF16=True, VASM=True, PRE=True, QLO=True, KIND=0)
INT8_LACC = dict(INT8_BEST, LACC=True)
GPU_VARIANTS = [  # (name, constexprs, (block_n, warps, stages)); block_n is ignored by the warp-batched kernel
    ("q8", INT8_BEST, (64, 4, 2)),
    ("q8 lacc", INT8_LACC, (64, 4, 2)),
    ("q8 lacc", INT8_LACC, (64, 4, 3)),
    ("q8 lacc", INT8_LACC, (32, 4, 3)),
    ("q8 lacc", INT8_LACC, (32, 4, 4)),
    ("q8 lacc", INT8_LACC, (128, 4, 2)),
]
FP8_VARIANTS = [(name, dict(QK8=False, VF16=False, VASM=False, PRE=True, QLO=False, LACC=lacc), cfg)
                for name, lacc, cfg in (("f8", False, (64, 4, 2)), ("f8 lacc", True, (64, 4, 2)),
                                        ("f8 lacc", True, (128, 4, 3)), ("f8 lacc", True, (32, 4, 3)))]


def gpu_main() -> None:
    """Time the variants against the shipped kernels on the GPU; a markdown table on stdout and $OUT."""
    import os
    import sys
    import torch
    sys.path.insert(0, os.path.dirname(__file__))
    import sass_stats
    from bench_kernels import bench_graph, kv_bytes, paged_cache, quantized_cache, rel_err
    from minfer.benchmark.offline import HBM_BYTES_PER_S
    from minfer.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    fmts = os.environ.get("KV8_FORMATS", "int8,fp8_e4m3,fp8_e5m2").split(",")
    cases = [("llama-8b heads", 64, 4096, 32, 8), ("llama-8b heads", 1, 32768, 32, 8)]
    lines = ["| shape | format | kernel | tile | splits | µs | share of 4.22 TB/s | × bf16 | rel err | regs / loop |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def row(shape, fmt, name, tile, splits, ms, nbytes, bf16_ms, err, sass=""):
        line = (f"| {shape} | {fmt} | {name} | {tile} | {splits} | {ms * 1e3:.1f} | {nbytes / (ms * 1e-3) / HBM_BYTES_PER_S:.0%} "
                f"| {bf16_ms / ms:.2f} | {err:.1e} | {sass} |")
        print(line, flush=True)
        lines.append(line)

    for label, batch, ctx, hq, hkv in cases:
        torch.manual_seed(0)
        shape = f"{label} B={batch}×{ctx}"
        kc, vc, table, lens = paged_cache([ctx] * batch, hkv, 128, 16)
        q = torch.randn(batch, hq, 128, device="cuda", dtype=torch.bfloat16)
        scale = 128 ** -0.5
        out = torch.empty_like(q)
        ref = paged_decode_attention_ref(q, kc, vc, table, lens, scale)
        bf16_ms = bench_graph(lambda: paged_decode_attention(q, kc, vc, table, lens, scale, out))
        row(shape, "bf16", "shipped", "default", "default", bf16_ms, kv_bytes(batch * ctx, hkv, 128, "auto"), bf16_ms,
            rel_err(out, ref))
        split_set = (1, 2, 4) if batch * hkv >= 256 else (16, 32, 64)
        for fmt in fmts:
            if fmt != "int8" and label.startswith("qwen3"):
                continue
            kq, vq, ks, vs = quantized_cache(kc, vc, fmt)
            sc = dict(k_scale=ks, v_scale=vs)
            ref = paged_decode_attention_ref(q, kq, vq, table, lens, scale, **sc)
            nbytes = kv_bytes(batch * ctx, hkv, 128, fmt)
            ms = bench_graph(lambda: paged_decode_attention(q, kq, vq, table, lens, scale, out, **sc))
            row(shape, fmt, "shipped", "default", "default", ms, nbytes, bf16_ms, rel_err(out, ref))
            kind = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}[fmt]
            variants = GPU_VARIANTS if fmt == "int8" else [(n, dict(c, KIND=kind), t) for n, c, t in FP8_VARIANTS]
            for name, const, (bn, w, st) in variants:
                for splits in split_set:
                    c = dict(const, BLOCK_N=bn)
                    try:
                        kern = run_variant(q, kq, vq, ks, vs, table, lens, scale, out, c, w, st, splits)
                        err = rel_err(out, ref)
                        ms = bench_graph(lambda: run_variant(q, kq, vq, ks, vs, table, lens, scale, out, c, w, st, splits))
                    except Exception as e:  # a variant that does not compile is a finding, not a crash
                        print(f"  {name} {bn}/{w}/{st} x{splits}: {type(e).__name__}: {str(e)[-400:]}", flush=True)
                        continue
                    try:
                        loop = sass_stats.main_loop(sass_stats.sass_of(kern))
                        info = f"{kern.n_regs} / {len(loop)}"
                    except Exception as e:
                        info = f"{getattr(kern, 'n_regs', '?')} / ? ({type(e).__name__})"
                    row(shape, fmt, name, f"{bn}/{w}/{st}", splits, ms, nbytes, bf16_ms, err, info)
            del kq, vq, ks, vs
        del kc, vc
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "kv8_variants.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def sass_main() -> None:
    import sys
    import os
    sys.path.insert(0, os.path.dirname(__file__))
    import sass_stats
    for qk8 in (False, True):
        for vf16 in (False, True):
            for bn, w, st in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2)):
                const = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, PAGE=16, BLOCK_N=bn, QK8=qk8, VF16=vf16)
                sig = dict(SIG, **{k: "constexpr" for k in const})
                k = sass_stats.compile_sm90(q8_split_kernel, sig, const, w, st, ("stride_btb", "num_splits"))
                sass_stats.report(f"QK8={qk8:d} VF16={vf16:d} {bn}/{w}/{st}", k, "--dump" in sys.argv)


if __name__ == "__main__":
    import sys
    gpu_main() if "--gpu" in sys.argv else sass_main()
