"""Gated DeltaNet's ops (Qwen3.5's linear attention): the torch references against HF's own functions, the Triton
kernels against the references, over flat varlen steps.

The references (``gated_delta_ref.py``) against ``transformers.models.qwen3_5.modeling_qwen3_5``: a prompt cut
into two chunks at 1, 63, 64 and 65 tokens (the second chunk starts from the state the first left in its slot,
so HF's 64-token chunks are cut anywhere) equals HF's chunked function over the whole prompt, output and final
state; decodes after it equal HF's recurrent step from that state; the conv's chunks and decodes equal HF's
``causal_conv1d_fn`` / ``causal_conv1d_update`` and its buffer is HF's conv state less its unread first column.
Value heads are twice the key heads (HF's ``repeat_interleave`` grouping).

The kernels (Triton's interpreter on the CPU) against the references on ragged steps: decodes alone (the
recurrent kernel), decodes and prompt chunks mixed (the chunked pair: chunks across 64-token block edges, a chunk
of one token, sequences sharing a block), some sequences with a state and some without, slots out of order, float32
and bfloat16 inputs (float32 state); the gates computed in the kernels from the raw projections (softplus past its
threshold and far below zero included); the gated output norm; then a few steps in a row against HF over whole
sequences. ``gpu`` tests: Qwen3.5-9B's layer shapes on CUDA, decode steps inside a CUDA graph, the kernels' gates
and the gated norm against the torch arithmetic they replace.

Tolerances (relative Frobenius error):
- reference vs HF, float32: 1e-5 (seen ~1e-6: HF's chunks restart where ours do, the same products in
  another grouping); bfloat16 outputs 1e-2 (an output rounding tipped by that float32 noise) and states 1e-5.
  Decodes (HF's recurrent step, op for op): 1e-6. The conv: 1e-6 in float32, 1e-2 in bfloat16 (one rounding).
- kernels vs reference, float32: 1e-5 (seen ~1e-6: the block-diagonal doubling inverse against a triangular
  solve, other summation orders). bfloat16 outputs 1e-2 under the interpreter, which rounds float32 -> bfloat16
  toward zero (``kernel_testlib``), 5e-3 on a GPU; states (float32 from the same inputs) 1e-5, 1e-3 on a GPU
  (tf32x3 products, another order of sums over 4k tokens). The conv's bfloat16 outputs 2e-2 under the interpreter
  (seen 7e-3: the conv's rounding and the SiLU's, both toward zero), 5e-3 on a GPU; its buffers hold copies of
  inputs: equal.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testlib import EXACT_BF16, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse)
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from minfer.kernels.linear_attention.causal_conv import causal_conv1d
from minfer.kernels.linear_attention.gated_delta import gated_delta_rule
from minfer.kernels.linear_attention.gated_delta_ref import (causal_conv1d_ref, gated_delta_rule_ref, gated_rms_norm_ref,
                                                          gdn_gates_ref)
from minfer.kernels.linear_attention.gated_norm import gated_rms_norm

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if not EXACT_BF16 else 5e-3}
CONV_TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2 if not EXACT_BF16 else 5e-3}  # two roundings toward zero
STATE_TOL = 1e-5
HK, HV, DK, DV = 2, 4, 32, 16  # Hv = 2 Hk


def gdn_inputs(t: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: str = "cpu") -> tuple:
    """q, k, v (the conv's outputs: unit-scale), g (float32 log decay as the layer computes it, per-head rates
    from slow to fast) and beta (sigmoid of a projection) for ``t`` tokens."""
    q, k = (torch.randn(t, hk, dk, device=device).to(dtype) for _ in range(2))
    v = torch.randn(t, hv, dv, device=device).to(dtype)
    rate = torch.linspace(0.02, 1.0, hv, device=device)
    g = -rate * F.softplus(torch.randn(t, hv, device=device) - 1.0)
    beta = torch.randn(t, hv, device=device).sigmoid().to(dtype)
    return q, k, v, g, beta


def gate_inputs(t: int, hv: int, dtype: torch.dtype, device: str = "cpu") -> tuple:
    """The layer's raw gate inputs: a and b as views of a fused [T, Z + 2 Hv] projection (strided rows), A_log as HF
    initialises it (log of U(1, 16)) and dt_bias; a few of a's entries far past softplus's threshold (20) and
    far below zero, where log1p(exp(x)) must not round to zero."""
    zba = (torch.randn(t, 8 + 2 * hv, device=device) * 3).to(dtype)
    zba[::3, -1] = 30.0
    zba[1::3, -2] = -30.0
    b, a = zba[:, 8:].split([hv, hv], dim=-1)
    a_log = torch.empty(hv, device=device).uniform_(1, 16).log().to(dtype)
    return a, b, a_log, (torch.randn(hv, device=device) * 0.5).to(dtype)


def step_tensors(lens: list[int], slots: list[int], has: list[bool], device: str = "cpu") -> tuple:
    qsl = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    return qsl, torch.tensor(slots, dtype=torch.int32, device=device), torch.tensor(has, device=device)


def hf_chunk(q, k, v, g, beta, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's chunked gated delta rule over one sequence (q [L, Hk, Dk] ...): (o [L, Hv, Dv], final state)."""
    o, s = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], s


# ---- references against HF --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cut", [1, 63, 64, 65])
def test_ref_chunked_prefill_equals_hf(cut: int, dtype: torch.dtype) -> None:
    """A 150-token prompt in two chunks (the second beside another sequence's decode) against HF over it whole."""
    n = 150
    q, k, v, g, beta = gdn_inputs(n + 1, HK, HV, DK, DV, dtype)
    want, want_state = hf_chunk(q[:n], k[:n], v[:n], g[:n], beta[:n])
    state = torch.full((5, HV, DK, DV), float("nan"))  # a fresh slot's contents are never read
    other = torch.randn(HV, DK, DV)
    state[1] = other
    first = gated_delta_rule_ref(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state,
                                 *step_tensors([cut], [3], [False]))
    # step 2: the other sequence's decode (token n, slot 1), then the rest of the prompt
    rows = [n] + list(range(cut, n))
    second = gated_delta_rule_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], state,
                                  *step_tensors([1, n - cut], [1, 3], [True, True]))
    out = torch.cat([first, second[1:]])
    tol = OUT_TOL[torch.float32] if dtype == torch.float32 else 1e-2
    assert rel_err(out, want.to(out.dtype)) <= tol
    assert rel_err(state[3], want_state[0]) <= STATE_TOL
    o1, s1 = hf.torch_recurrent_gated_delta_rule(q[None, n:], k[None, n:], v[None, n:], g[None, n:],
                                                 beta[None, n:], initial_state=other[None],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(second[:1], o1[0]) <= 1e-6 and rel_err(state[1], s1[0]) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ref_decodes_equal_hf_recurrent(dtype: torch.dtype) -> None:
    """Two prompts, then three steps of their decodes (listed in the other order): each decode is HF's recurrent
    step from the state HF's chunked prefill left."""
    lens, decodes = [70, 9], 3
    seqs = [gdn_inputs(n + decodes, HK, HV, DK, DV, dtype) for n in lens]
    state = torch.zeros(4, HV, DK, DV)
    slots = [2, 0]
    prompts = [torch.cat([x[:n] for x, n in zip(parts, lens)]) for parts in zip(*seqs)]
    gated_delta_rule_ref(*prompts, state, *step_tensors(lens, slots, [False, False]))
    hf_states = [hf_chunk(*(x[:n] for x in seq))[1] for seq, n in zip(seqs, lens)]
    order = [1, 0]
    for i in range(decodes):
        rows = [torch.stack([seqs[b][j][lens[b] + i] for b in order]) for j in range(5)]
        out = gated_delta_rule_ref(*rows, state, *step_tensors([1, 1], [slots[b] for b in order], [True, True]))
        for row, b in enumerate(order):
            n = lens[b]
            o, hf_states[b] = hf.torch_recurrent_gated_delta_rule(
                *(x[None, n + i:n + i + 1] for x in seqs[b]), initial_state=hf_states[b], output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            assert rel_err(out[row], o[0, 0]) <= (1e-6 if dtype == torch.float32 else 1e-2)
            assert rel_err(state[slots[b]], hf_states[b][0]) <= 1e-6


def hf_conv_state(prompt: torch.Tensor, k: int) -> torch.Tensor:
    """HF's conv state after a prefill ([1, C, K]): the prompt's last K inputs, zeros before it."""
    return F.pad(prompt.t()[None], (max(0, k - prompt.shape[0]), 0))[..., -k:].clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_ref_conv_equals_hf(cut: int, dtype: torch.dtype) -> None:
    """A 9-token prompt in two chunks, then two decodes, against HF's conv over the prompt and its decode update;
    the slot's buffer is HF's state without its first column."""
    c, kk, n, decodes = 24, 4, 9, 2
    x = torch.randn(n + decodes, c).to(dtype)
    w = torch.randn(c, kk).to(dtype)
    buf = torch.full((3, c, kk - 1), float("nan")).to(dtype)
    out = [causal_conv1d_ref(x[:cut], w, buf, *step_tensors([cut], [1], [False])),
           causal_conv1d_ref(x[cut:n], w, buf, *step_tensors([n - cut], [1], [True]))]
    want = [hf.causal_conv1d_fn(x[:n].t()[None], w, activation="silu")[0].t()]
    hf_state = hf_conv_state(x[:n], kk)
    assert torch.equal(buf[1], hf_state[0, :, 1:])
    for i in range(n, n + decodes):
        out.append(causal_conv1d_ref(x[i:i + 1], w, buf, *step_tensors([1], [1], [True])))
        want.append(hf.causal_conv1d_update(x[i:i + 1].t()[None], hf_state, w, activation="silu")[0].t())
        assert torch.equal(buf[1], hf_state[0, :, 1:])
    assert rel_err(torch.cat(out), torch.cat(want)) <= (1e-6 if dtype == torch.float32 else 1e-2)


# ---- kernels against the references -----------------------------------------------------------------------------

# (lengths, has_state): decodes alone (the recurrent kernel); decodes then chunks mixed (the chunked pair): chunks
# across 64-token blocks, a fresh one-token chunk, short chunks sharing a block, a whole 64-token block
CASES = {
    "decodes": ([1, 1, 1, 1, 1], [True, True, False, True, True]),
    "mixed": ([1, 1, 1, 70, 5, 1, 130, 2, 64], [True, True, True, False, True, False, True, True, False]),
}


def ragged(case: str, num_slots: int = 12) -> tuple[list[int], list[int], list[bool]]:
    lens, has = CASES[case]
    return lens, torch.randperm(num_slots)[:len(lens)].tolist(), has


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dims", [(HK, HV, DK, DV), (1, 3, 16, 64)], ids=["gqa2", "gqa3_dv64"])
def test_gated_delta_kernel(case: str, dims: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    lens, slots, has = ragged(case)
    hk, hv, dk, dv = dims
    q, k, v, g, beta = gdn_inputs(sum(lens), hk, hv, dk, dv, dtype)
    state = torch.randn(12, hv, dk, dv) * 0.3
    want_state = state.clone()
    step = step_tensors(lens, slots, has)
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *step)
    out = gated_delta_rule(q, k, v, g, beta, state, *step)
    assert out.dtype == dtype
    assert rel_err(out, want) <= OUT_TOL[dtype]
    assert rel_err(state, want_state) <= STATE_TOL  # untouched slots included


@pytest.mark.parametrize("case,dtype", [("decodes", torch.float32), ("decodes", torch.bfloat16),
                                        ("mixed", torch.bfloat16)], ids=["decodes-fp32", "decodes-bf16", "mixed-bf16"])
def test_gated_delta_kernel_gates_from_projections(case: str, dtype: torch.dtype) -> None:
    """With A_log and dt_bias the kernels take the projections a and b and gate them in registers: as the reference
    after HF's gates (``gdn_gates_ref``)."""
    lens, slots, has = ragged(case)
    t = sum(lens)
    q, k, v, _, _ = gdn_inputs(t, HK, HV, DK, DV, dtype)
    a, b, a_log, dt_bias = gate_inputs(t, HV, dtype)
    state = torch.randn(12, HV, DK, DV) * 0.3
    want_state = state.clone()
    step = step_tensors(lens, slots, has)
    want = gated_delta_rule_ref(q, k, v, *gdn_gates_ref(a, b, a_log, dt_bias), want_state, *step)
    out = gated_delta_rule(q, k, v, a, b, state, *step, A_log=a_log, dt_bias=dt_bias)
    assert rel_err(out, want) <= OUT_TOL[dtype]
    # bfloat16 under the interpreter: β rounds toward zero there, to nearest in torch (a bias the state keeps)
    assert rel_err(state, want_state) <= (STATE_TOL if dtype == torch.float32 or EXACT_BF16 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_rms_norm_kernel(dtype: torch.dtype) -> None:
    """The output norm over 3 tokens of 5 heads of 24 (masked tiles), the gate a strided view of z|b|a."""
    x = torch.randn(3, 5, 24).to(dtype)
    zba = (torch.randn(3, 5 * 24 + 10) * 2).to(dtype)
    z = zba[:, :120].view(3, 5, 24)
    w = (1 + 0.2 * torch.randn(24)).to(dtype)
    out = gated_rms_norm(x, z, w, 1e-6)
    assert out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, gated_rms_norm_ref(x, z, w, 1e-6)) <= (1e-6 if dtype == torch.float32 else CONV_TOL[dtype])


@pytest.mark.parametrize("case", list(CASES))
def test_gated_delta_kernel_views_and_options(case: str) -> None:
    """q, k, v as views of one fused [T, C] product (as the layer passes them), no L2 norm, an explicit scale."""
    lens, slots, has = ragged(case)
    t = sum(lens)
    qkv = torch.randn(t, 2 * HK * DK + HV * DV)
    q, k, v = (x.reshape(t, -1, d) for x, d in zip(qkv.split([HK * DK, HK * DK, HV * DV], 1), (DK, DK, DV)))
    _, _, _, g, beta = gdn_inputs(t, HK, HV, DK, DV, torch.float32)
    q, k = q * 0.2, k * 0.2  # unnormalised keys: keep the delta rule stable
    state = torch.randn(12, HV, DK, DV) * 0.3
    want_state = state.clone()
    step = step_tensors(lens, slots, has)
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *step, use_qk_l2norm=False, scale=0.5)
    out = gated_delta_rule(q, k, v, g, beta, state, *step, use_qk_l2norm=False, scale=0.5)
    assert rel_err(out, want) <= 1e-5 and rel_err(state, want_state) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(CASES) + ["short"])
@pytest.mark.parametrize("kernel_size", [4, 2])
def test_causal_conv_kernel(case: str, kernel_size: int, dtype: torch.dtype) -> None:
    """160 channels (two tiles, the second partial); "short": chunks shorter than the buffer, with a state."""
    lens, slots, has = ([1, 2, 3, 2], [4, 0, 7, 2], [True, True, True, False]) if case == "short" else ragged(case)
    c = 160
    x = torch.randn(sum(lens), c).to(dtype)
    w = torch.randn(c, kernel_size).to(dtype)
    buf = torch.randn(12, c, kernel_size - 1).to(dtype)
    want_buf = buf.clone()
    step = step_tensors(lens, slots, has)
    want = causal_conv1d_ref(x, w, want_buf, *step)
    out = causal_conv1d(x, w, buf, *step)
    assert out.dtype == dtype
    assert rel_err(out, want) <= CONV_TOL[dtype]
    assert torch.equal(buf, want_buf)


def test_kernels_across_steps_equal_hf() -> None:
    """The conv and the delta rule in Triton over three steps (two prompts chunked, then decodes), each sequence's
    outputs against HF's functions over its whole tokens."""
    hk, hv, dk, dv, kk = HK, HV, DK, DV, 4
    c = 2 * hk * dk + hv * dv
    n = [105, 101]
    x = [torch.randn(m, c) for m in n]
    w = torch.randn(c, kk) / 2
    gdn = [gdn_inputs(m, hk, hv, dk, dv, torch.float32)[3:] for m in n]  # g, beta
    steps = [[(0, 0, 40, False), (1, 0, 100, False)],  # (sequence, first token, last + 1, has state)
             [(1, 100, 101, True), (0, 40, 104, True)],
             [(0, 104, 105, True)]]
    slots = [5, 2]
    buf, state = torch.zeros(8, c, kk - 1), torch.zeros(8, hv, dk, dv)
    outs: list[list[torch.Tensor]] = [[], []]
    for step in steps:
        lens = [hi - lo for _, lo, hi, _ in step]
        meta = step_tensors(lens, [slots[s] for s, *_ in step], [h for *_, h in step])
        xs = torch.cat([x[s][lo:hi] for s, lo, hi, _ in step])
        qkv = causal_conv1d(xs, w, buf, *meta)
        t = qkv.shape[0]
        q, k, v = (y.reshape(t, -1, d) for y, d in zip(qkv.split([hk * dk, hk * dk, hv * dv], 1), (dk, dk, dv)))
        g, beta = (torch.cat([gdn[s][i][lo:hi] for s, lo, hi, _ in step]) for i in range(2))
        o = gated_delta_rule(q, k, v, g, beta, state, *meta)
        for (s, *_), part in zip(step, o.split(lens)):
            outs[s].append(part)
    for s in range(2):
        qkv = hf.causal_conv1d_fn(x[s].t()[None], w, activation="silu")[0].t()
        t = qkv.shape[0]
        q, k, v = (y.reshape(t, -1, d) for y, d in zip(qkv.split([hk * dk, hk * dk, hv * dv], 1), (dk, dk, dv)))
        want, want_state = hf_chunk(q, k, v, *gdn[s])
        assert rel_err(torch.cat(outs[s]), want) <= 1e-5
        assert rel_err(state[slots[s]], want_state[0]) <= 1e-5
        assert torch.equal(buf[slots[s]], x[s][-(kk - 1):].t())


# ---- the ops ----------------------------------------------------------------------------------------------------

def test_ops_torch_and_triton_agree() -> None:
    """``Ops.causal_conv1d`` / ``Ops.gated_delta_rule`` (its gates from the projections) / ``Ops.gated_rms_norm``: the
    torch ops (the references) and the Triton ops."""
    from minfer.ops import TorchOps
    from minfer.ops.triton_ops import TritonOps

    lens, slots, has = ragged("mixed")
    step = step_tensors(lens, slots, has)
    c = 2 * HK * DK + HV * DV
    x, w = torch.randn(sum(lens), c), torch.randn(c, 4)
    q, k, v, _, _ = gdn_inputs(sum(lens), HK, HV, DK, DV, torch.float32)
    gates = gate_inputs(sum(lens), HV, torch.float32)
    z, nw = torch.randn(sum(lens), HV, DV), torch.randn(DV)
    results = []
    for ops in (TorchOps(), TritonOps(torch.device("cpu"), 16, 64)):
        buf, state = torch.ones(12, c, 3), torch.ones(12, HV, DK, DV) * 0.1
        o = ops.gated_delta_rule(q, k, v, *gates, state, *step)
        results.append((ops.causal_conv1d(x, w, buf, *step), buf, o, state, ops.gated_rms_norm(o, z, nw, 1e-6)))
    for a, b in zip(*results):  # (the gates' exp and log1p from two libraries: float32 noise, grown by decays of e^-400)
        assert rel_err(a, b) <= 5e-5


# ---- GPU: Qwen3.5-9B's layer (linear_num_key_heads 16, linear_num_value_heads 32, head dims 128, conv 4) --------

QWEN35_9B = dict(hk=16, hv=32, dk=128, dv=128, kernel=4)
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_step(lens: list[int], has: list[bool], num_slots: int = 80) -> tuple:
    s = QWEN35_9B
    c = 2 * s["hk"] * s["dk"] + s["hv"] * s["dv"]
    t = sum(lens)
    qkv = torch.randn(t, c, device="cuda").to(torch.bfloat16)
    q, k, v = (y.reshape(t, -1, d) for y, d in zip(qkv.split([s["hk"] * s["dk"]] * 2 + [s["hv"] * s["dv"]], 1),
                                                    (s["dk"], s["dk"], s["dv"])))
    _, _, _, g, beta = gdn_inputs(t, s["hk"], s["hv"], s["dk"], s["dv"], torch.bfloat16, "cuda")
    slots = torch.randperm(num_slots)[:len(lens)].tolist()
    state = torch.randn(num_slots, s["hv"], s["dk"], s["dv"], device="cuda") * 0.1
    buf = torch.randn(num_slots, c, s["kernel"] - 1, device="cuda").to(torch.bfloat16)
    w = (torch.randn(c, s["kernel"], device="cuda") / 2).to(torch.bfloat16)
    return qkv, w, buf, (q, k, v, g, beta), state, step_tensors(lens, slots, has, "cuda")


def check_gpu(lens: list[int], has: list[bool]) -> None:
    qkv, w, buf, gdn, state, step = gpu_step(lens, has)
    want_buf, want_state = buf.clone(), state.clone()
    assert rel_err(causal_conv1d(qkv, w, buf, *step), causal_conv1d_ref(qkv, w, want_buf, *step)) <= 5e-3
    assert torch.equal(buf, want_buf)
    assert rel_err(gated_delta_rule(*gdn, state, *step), gated_delta_rule_ref(*gdn, want_state, *step)) <= 5e-3
    assert rel_err(state, want_state) <= 1e-3


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode(batch: int) -> None:
    check_gpu([1] * batch, [True] * batch)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("lens,has", [([4096], [False]), ([1] * 8 + [1000, 2500, 77], [True] * 9 + [False, True])],
                         ids=["prefill4k", "mixed"])
def test_gpu_prefill(lens: list[int], has: list[bool]) -> None:
    check_gpu(lens, has)


@pytest.mark.gpu
@requires_gpu
def test_gpu_decode_cuda_graph() -> None:
    """Both decode kernels captured in a CUDA graph: a replay on new inputs equals an eager run on them."""
    qkv, w, buf, gdn, state, step = gpu_step([1] * 16, [True] * 16)
    inputs = [qkv, *gdn[3:]]

    def run() -> torch.Tensor:
        y = causal_conv1d(inputs[0], w, buf, *step)
        t = y.shape[0]
        s = QWEN35_9B
        q, k, v = (a.reshape(t, -1, d) for a, d in zip(y.split([s["hk"] * s["dk"]] * 2 + [s["hv"] * s["dv"]], 1),
                                                        (s["dk"], s["dk"], s["dv"])))
        return gated_delta_rule(q, k, v, inputs[1], inputs[2], state, *step)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    saved = buf.clone(), state.clone()
    with torch.cuda.graph(graph):
        out = run()
    buf.copy_(saved[0]), state.copy_(saved[1])
    inputs[0].copy_(torch.randn_like(inputs[0]))
    inputs[1].copy_(-torch.rand_like(inputs[1]))
    inputs[2].copy_(torch.rand_like(inputs[2]))
    graph.replay()
    got, got_buf, got_state = out.clone(), buf.clone(), state.clone()
    buf.copy_(saved[0]), state.copy_(saved[1])
    assert torch.equal(run(), got) and torch.equal(buf, got_buf) and torch.equal(state, got_state)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_gates_and_norm_from_projections(batch: int) -> None:
    """At Qwen3.5-9B's shapes in bfloat16: the recurrent kernel gating a and b itself equals it fed the torch gates
    (HF's arithmetic, the unfused path) to the noise of exp/log1p, and the gated-norm kernel equals HF's torch norm
    to bf16 rounding."""
    _, _, _, (q, k, v, _, _), state, step = gpu_step([1] * batch, [True] * batch)
    a, b, a_log, dt_bias = gate_inputs(batch, QWEN35_9B["hv"], torch.bfloat16, "cuda")
    want_state = state.clone()
    want = gated_delta_rule(q, k, v, *gdn_gates_ref(a, b, a_log, dt_bias), want_state, *step)
    out = gated_delta_rule(q, k, v, a, b, state, *step, A_log=a_log, dt_bias=dt_bias)
    # (a sigmoid one float32 ulp apart may round β to the other bfloat16 neighbour: 1e-3 for the states)
    assert rel_err(out, want) <= 5e-3 and rel_err(state, want_state) <= 1e-3
    z = torch.randn(batch, QWEN35_9B["hv"], QWEN35_9B["dv"], device="cuda").to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(QWEN35_9B["dv"], device="cuda")).to(torch.bfloat16)
    assert rel_err(gated_rms_norm(out, z, w, 1e-6), gated_rms_norm_ref(out, z, w, 1e-6)) <= 5e-3
