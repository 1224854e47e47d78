"""The Triton pieces both MoE paths share (the grouped GEMMs of ``moe.py``, the matrix-vector kernels of
``moe_decode.py``): a token's routing, and the roundings of the two epilogues. One copy of each, so a token routes
to the same experts, and its rows round the same way, whichever path a step takes.

Routing selects the top k by k rounds of one max-reduction over packed keys: each lane's score mapped to an int32
that orders as the float does, shifted into the high half of an int64 whose low half is ``E_PAD - 1 - e``. The
largest key is the largest score, and among equal scores the lowest expert (what ``torch.topk`` does on the CPU in
practice, though it promises nothing). One reduction a round instead of two (max, then the lowest index holding
it): the decode kernels route in every program, so the rounds are on their critical path.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _top_k_slots(score, e, E, TOP_K: tl.constexpr):
    """``score [E_PAD]`` float32 -> each lane's place among the TOP_K largest (0 for the largest), -1 outside them
    (padding lanes, ``e >= E``, never chosen). ``score + 0.0`` turns -0.0 into +0.0, which compare equal."""
    E_PAD: tl.constexpr = score.shape[0]
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    key = (ordered.to(tl.int64) << 32) | (e.to(tl.int64) ^ (E_PAD - 1))  # low half E_PAD - 1 - e (E_PAD: 2 ** n)
    taken = -9223372036854775807 - 1  # below every key
    key = tl.where(e < E, key, taken)
    slot = tl.full([E_PAD], -1, tl.int32)
    for j in tl.static_range(TOP_K):
        best = (tl.max(key, axis=0) & 0xFFFFFFFF) ^ (E_PAD - 1)
        slot = tl.where(e == best, j, slot)
        key = tl.where(e == best, taken, key)
    return slot


@triton.jit
def route_row(logits, e, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, TOPK_SOFTMAX: tl.constexpr):
    """One token's routing: ``logits [E_PAD]`` float32 (``-inf`` on padding lanes) -> (slot [E_PAD] int32: each
    expert's place in the token's top k, -1 if not chosen; weight [E_PAD] float32, 0 where not chosen; the caller
    rounds it to the weights dtype). HF's routers (``moe_ref.moe_route_ref``): a float32 softmax over the experts,
    the top k, renormalised when RENORM; or (TOPK_SOFTMAX, gpt-oss) the top k of the logits, then a softmax over
    those k."""
    if TOPK_SOFTMAX:
        slot = _top_k_slots(logits, e, E, TOP_K)
        sel = slot >= 0
        p = tl.where(sel, tl.exp(logits - tl.max(tl.where(sel, logits, float("-inf")), axis=0)), 0.0)
        w = tl.math.div_rn(p, tl.sum(p, axis=0))
    else:
        p = tl.exp(logits - tl.max(logits, axis=0))
        probs = tl.math.div_rn(p, tl.sum(p, axis=0))
        slot = _top_k_slots(probs, e, E, TOP_K)
        w = tl.where(slot >= 0, probs, 0.0)
        if RENORM:
            w = tl.math.div_rn(w, tl.sum(w, axis=0))
    return slot, w


@triton.jit
def swiglu_epilogue(acc_g, acc_u, bias_g, bias_u, DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr,
                    ALPHA: tl.constexpr):
    """float32 gate and up sums -> the activation in DTYPE, with HF's roundings: each projection to the dtype, each
    bias (float32 values broadcast to the sums' shape; unused without HAS_BIAS) added in place (one more rounding),
    then ``silu(gate) * up`` as ``activation.py`` rounds it, or with LIMIT > 0 gpt-oss's clamped SwiGLU with every
    op rounded (``moe_ref.swiglu_ref``)."""
    g = acc_g.to(DTYPE).to(tl.float32)
    u = acc_u.to(DTYPE).to(tl.float32)
    if HAS_BIAS:
        g = (g + bias_g).to(DTYPE).to(tl.float32)
        u = (u + bias_u).to(DTYPE).to(tl.float32)
    if LIMIT > 0:
        g = tl.minimum(g, LIMIT).to(DTYPE).to(tl.float32)
        u = tl.maximum(tl.minimum(u, LIMIT), -LIMIT).to(DTYPE).to(tl.float32)
        ga = (g * ALPHA).to(DTYPE).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-ga))).to(DTYPE).to(tl.float32)
        glu = (g * sig).to(DTYPE).to(tl.float32)
        return ((u + 1.0).to(DTYPE).to(tl.float32) * glu).to(DTYPE)
    act = (g / (1.0 + tl.exp(-g))).to(DTYPE)
    return (act.to(tl.float32) * u).to(DTYPE)


@triton.jit
def down_epilogue(acc, bias, weight, DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A float32 down-projection sum -> ``weight * (proj (+ bias))`` in float32, HF's roundings before the product:
    the projection to the activations' DTYPE, the bias added in place (rounded again). The caller rounds the product
    to its dtype (x's, or float32 for float32 router weights: torch's promotion of ``proj * weight``)."""
    y = acc.to(DTYPE).to(tl.float32)
    if HAS_BIAS:
        y = (y + bias).to(DTYPE).to(tl.float32)
    return y * weight
