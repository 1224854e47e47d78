"""Gated DeltaNet's two sequence ops as torch references over a flat varlen step, torch only: the torch ops run
them (``minfer/ops/base.py``) and the Triton kernels (``causal_conv.py``, ``gated_delta.py``) are held to them.

A step is a flat list of T tokens cut into sequences by ``query_start_loc`` ``[B + 1]`` (decodes, one token
each, then prompt chunks). Sequence b keeps its state in slot ``slots[b]`` of the layer's state tensors; it
starts from that state when ``has_state[b]`` (a decode, or a prompt chunk after the first), from zeros otherwise,
and leaves its state after its last token there. A chunk may stop anywhere, so a prompt cut into chunks gives
the numbers one HF forward over the whole prompt gives (to float32 rounding: HF's 64-token chunks restart at
each of our chunks).

The arithmetic is HF's (``transformers.models.qwen3_5.modeling_qwen3_5``): the conv in the model dtype with its
output rounded before the SiLU; the delta rule in float32 on q, k, v, g, beta converted first, q and k
L2-normalised (``x * rsqrt(sum(x²) + 1e-6)``) then q scaled; a one-token sequence takes HF's recurrent step, a
longer one HF's chunked (UT-transform) form, and the output is rounded once to q's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # HF's chunk of the UT-transform form
L2NORM_EPS = 1e-6  # HF's (and fla's) l2norm epsilon


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """HF's ``l2norm`` over the last dimension: ``x * rsqrt(sum(x²) + eps)`` (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's log decay and write strength from the layer's two small projections, HF's order:
    ``g = -exp(A_log) · softplus(a + dt_bias)`` in float32 and ``β = sigmoid(b)`` in b's dtype. a, b [T, Hv]
    (model dtype), A_log, dt_bias [Hv]; returns (g float32 [T, Hv], beta [T, Hv])."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, then times ``silu(gate)``, with HF's roundings (``Qwen3_5RMSNormGated``):
    the normed value rounded to x's dtype before the weight, the gate applied in float32, one last rounding."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def _token_sequences(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's sequence index (int64 [T]); an empty sequence owns no token."""
    qsl = query_start_loc.long()
    return torch.searchsorted(qsl[1:], torch.arange(num_tokens, device=qsl.device), right=True)


def _window_rows(local: torch.Tensor, flat: torch.Tensor, slot: torch.Tensor, has: torch.Tensor, num_tokens: int,
                 state_len: int, zero_row: int) -> torch.Tensor:
    """Rows of the conv's source table (x's T rows, then each slot's ``state_len`` buffered inputs, then a zero
    row) for positions ``local`` of a sequence (negative: before its first token, so out of its slot's buffer, or
    zero without a state) at flat positions ``flat``."""
    from_state = num_tokens + slot * state_len + state_len + local
    return torch.where(local >= 0, flat, torch.where(has, from_state, torch.full_like(flat, zero_row)))


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      query_start_loc: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv and SiLU over each sequence's channels, its window starting from its slot's buffer.

    ``x`` [T, C] (the fused q|k|v channels), ``weight`` [C, K] (HF's ``conv1d.weight`` squeezed; no bias in
    Qwen3.5), ``conv_state`` [S, C, K - 1] in x's dtype: slot s holds the last K - 1 *inputs* its sequence has seen
    (HF keeps K, ``causal_conv1d_update``'s window, whose first column the next conv never reads). Returns
    y [T, C] in x's dtype; ``conv_state[slots[b]]`` becomes the last K - 1 inputs of the buffer and the chunk
    (fewer than K - 1 new tokens keep the older ones). HF's rounding: the products summed in float32, the sum
    rounded to x's dtype (``F.conv1d`` in the model dtype), the SiLU on that and rounded again.
    """
    t, c = x.shape
    k = weight.shape[1]
    n = k - 1
    b = slots.shape[0]
    qsl = query_start_loc.long()
    starts, ends = qsl[:-1], qsl[1:]
    slot, has = slots.long(), has_state.bool()
    zero_row = t + conv_state.shape[0] * n
    src = torch.cat([x, conv_state.transpose(1, 2).reshape(-1, c).to(x.dtype), x.new_zeros(1, c)])

    seq = _token_sequences(query_start_loc, t)
    flat = torch.arange(t, device=x.device)[:, None] - n + torch.arange(k, device=x.device)  # [T, K]
    rows = _window_rows(flat - starts[seq][:, None], flat, slot[seq][:, None], has[seq][:, None], t, n, zero_row)
    y = (src[rows].float() * weight.t().float()).sum(1).to(x.dtype)

    # The new buffers: the last K - 1 positions of each sequence (read before the write: gathering copies)
    flat = ends[:, None] - n + torch.arange(n, device=x.device)  # [B, K - 1]
    rows = _window_rows(flat - starts[:, None], flat, slot[:, None], has[:, None], t, n, zero_row)
    if b:
        conv_state[slot] = src[rows].transpose(1, 2).to(conv_state.dtype)
    return F.silu(y)


def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for N sequences at once, HF's recurrent op order: decay the state,
    read k's memory out of it, write β times the error, read the output with q. q, k [N, H, Dk] (normalised,
    q scaled), v [N, H, Dv], g, beta [N, H], s [N, H, Dk, Dv], all float32; returns (o [N, H, Dv], new s)."""
    s = s * g.exp()[..., None, None]
    memory = (s * k[..., None]).sum(-2)
    delta = (v - memory) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in HF's chunked form: within each 64-token chunk the delta rule's updates are one
    unit-lower-triangular system (the UT transform), solved for the new values and the decayed keys that read the
    state; then a scan over chunks carries the state. q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], s
    [H, Dk, Dv], float32 (q, k normalised, q scaled); returns (o [H, L, Dv], the state after the last token).

    The last chunk is zero-padded as HF pads: a padded token has k = v = β = 0 and g = 0, so it changes no state.
    """
    h, length, _ = q.shape
    chunks = -(-length // CHUNK)
    pad = chunks * CHUNK - length

    def split(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, pad)).reshape(h, chunks, CHUNK, x.shape[-1])

    q, k, v = split(q), split(k), split(v)
    beta = F.pad(beta, (0, pad)).reshape(h, chunks, CHUNK, 1)
    cum = F.pad(g, (0, pad)).reshape(h, chunks, CHUNK).cumsum(-1)  # log decay from the chunk's start
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: the system is unit triangular
    new_values = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    out = torch.empty_like(new_values)
    for i in range(chunks):
        v_new = new_values[:, i] - state_keys[:, i] @ s
        out[:, i] = q[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, chunks * CHUNK, -1)[:, :length], s


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor,
                         has_state: torch.Tensor, use_qk_l2norm: bool = True,
                         scale: float | None = None) -> torch.Tensor:
    """The gated delta rule over a varlen step: per value head, ``S ← exp(g)·S``, ``S ← S + k (β (v - Sᵀk))ᵀ``,
    ``o = Sᵀq``, token by token within each sequence.

    q, k [T, Hk, Dk], v [T, Hv, Dv] (views of the conv's output are fine), g [T, Hv] (log decay, float32),
    beta [T, Hv], ``state`` [S, Hv, Dk, Dv] float32. Value head j reads q/k head ``j // (Hv / Hk)`` (HF's
    ``repeat_interleave``: consecutive value heads share a key head). ``scale`` defaults to ``Dk ** -0.5``.
    Returns o [T, Hv, Dv] in q's dtype; each sequence's state after its last token is written to its slot.
    """
    t, hk, dk = q.shape
    hv = v.shape[1]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    rep = hv // hk
    qf, kf = (x.repeat_interleave(rep, dim=1).float() if rep > 1 else x.float() for x in (q, k))
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    # HF's recurrent step divides by sqrt(Dk), its chunked form multiplies by Dk ** -0.5: the same to an ulp
    qf = qf * (dk ** -0.5 if scale is None else scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(t, hv, v.shape[2], dtype=q.dtype, device=q.device)

    bounds = query_start_loc.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    one = [i for i, n in enumerate(lengths) if n == 1]  # decodes (and one-token chunks), all at once
    if one:
        rows = query_start_loc[one].long()
        slot = slots[one].long()
        s0 = torch.where(has_state[one].bool()[:, None, None, None], state[slot], 0.0)
        o, s1 = _recurrent_step(qf[rows], kf[rows], vf[rows], gf[rows], bf[rows], s0)
        out[rows] = o.to(q.dtype)
        state[slot] = s1
    has_host, slot_host = has_state.tolist(), slots.tolist()
    for i, n in enumerate(lengths):
        if n < 2:
            continue
        lo, hi, slot = bounds[i], bounds[i + 1], slot_host[i]
        s0 = state[slot] if has_host[i] else state.new_zeros(state.shape[1:])
        seq = [x[lo:hi].transpose(0, 1) for x in (qf, kf, vf, gf, bf)]
        o, state[slot] = _chunked(*seq, s0)
        out[lo:hi] = o.transpose(0, 1).to(q.dtype)
    return out
