"""The fused q/k-norm + rotary + KV-store kernel against the separate steps it replaces (the norm and
store kernels, the float32 rotary reference), and against the torch references (CPU interpreter in
CI; the same checks on the GPU)."""
from __future__ import annotations

import pytest
import torch

from kernel_testlib import EXACT_BF16, REL_TOL, assert_close, seed_per_case  # noqa: F401 (seed_per_case: autouse)
from minfer.kernels.kv_store import store_kv
from minfer.kernels.rmsnorm import rms_norm
from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS
from minfer.kernels.rope_store import apply_rotary_ref, rope_q, rope_store_kv, rope_store_kv_ref
from minfer.model.layers.rotary import RotaryEmbedding

PAGE = 16


def _case(num_tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, kv_dtype: str | None, norm: bool,
          device: str, rotary_dim: int | None = None) -> dict:
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, device=device).to(dtype)
    q = qkv[:, :hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(num_tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(num_tokens, hkv, d)
    num_blocks = num_tokens // PAGE + 3
    slots = torch.randperm(num_blocks * PAGE, device=device)[:num_tokens]
    slots[::4] = -1  # padding rows
    positions = torch.randint(0, 4000, (num_tokens,), device=device)
    rope = RotaryEmbedding(rotary_dim or d, 4096, 500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    shape = (num_blocks, PAGE, hkv, d)
    if kv_dtype is None:
        caches = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(2)]
        scales = [None, None]
    else:
        code = KV_QUANT_FORMATS[kv_dtype].dtype
        caches = [torch.full(shape, 0x5A, dtype=torch.uint8, device=device).view(code) for _ in range(2)]
        scales = [torch.full((num_blocks, hkv, PAGE), float("nan"), device=device) for _ in range(2)]
    weights = [(1 + 0.2 * torch.randn(d, device=device)).to(dtype) for _ in range(2)] if norm else [None, None]
    return dict(qkv=qkv, q=q, k=k, v=v, positions=positions, cos_sin_cache=rope.cos_sin_cache.to(device),
                k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, k_scale=scales[0], v_scale=scales[1],
                q_norm_weight=weights[0], k_norm_weight=weights[1])


def _clone(case: dict) -> dict:
    out = {name: t.clone() if isinstance(t, torch.Tensor) and name not in ("q", "k", "v") else t
           for name, t in case.items()}
    hq, hkv = case["q"].shape[1], case["k"].shape[1]
    n, d = case["q"].shape[0], case["q"].shape[2]
    qkv = out["qkv"]
    out["q"] = qkv[:, :hq * d].view(n, hq, d)
    out["k"] = qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
    out["v"] = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
    return out


def _run_fused(case: dict) -> None:
    rope_store_kv(**{n: t for n, t in case.items() if n != "qkv"}, eps=1e-6)


def _run_separate(case: dict) -> None:
    """The unfused steps: q/k norm kernels, rotary (float32, one rounding), the store kernel."""
    q, k = case["q"], case["k"]
    if case["q_norm_weight"] is not None:
        q.copy_(rms_norm(q, case["q_norm_weight"], 1e-6))
        k = rms_norm(k, case["k_norm_weight"], 1e-6)
    else:
        k = k.clone()
    _rotate(q, k, case["positions"], case["cos_sin_cache"])
    store_kv(k, case["v"], case["k_cache"], case["v_cache"], case["slot_mapping"], case["k_scale"], case["v_scale"])


def _rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> None:
    """The rotary step alone, in place: float32 math rounded once, as a kernel rounds here (Triton's
    interpreter rounds float32 -> bfloat16 toward zero, see kernel_testlib.EXACT_BF16)."""
    qf, kf = q.float(), k.float()
    apply_rotary_ref(qf, kf, positions, cache)
    for x, xf in ((q, qf), (k, kf)):
        if x.dtype == torch.bfloat16 and not EXACT_BF16:
            xf = (xf.view(torch.int32) & -65536).view(torch.float32)  # drop the low 16 bits: toward zero
        x.copy_(xf)


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.nan_to_num(-7.0)


def check_rope_store(num_tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, kv_dtype: str | None,
                     norm: bool, device: str) -> None:
    case = _case(num_tokens, hq, hkv, d, dtype, kv_dtype, norm, device)
    fused, separate, ref = _clone(case), _clone(case), _clone(case)
    k_before = case["k"].clone()
    _run_fused(fused)
    _run_separate(separate)
    # The same arithmetic as the separate kernels, element for element: bit-identical under the
    # interpreter. Compiled, the norm's sum may associate differently: q within a rounding there.
    for name in ("qkv", "k_cache", "v_cache", "k_scale", "v_scale"):
        got, want = _bits(fused[name]), _bits(separate[name])
        if got is None:
            continue
        if device == "cpu":
            assert torch.equal(got, want), f"{name} differs from the separate kernels"
        elif name == "qkv":
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        else:  # 8-bit codes may move by one step where k moved by one rounding
            same = (got == want).float().mean().item()
            assert same > 0.99, f"{name}: only {same:.4f} of the elements equal the separate kernels'"
    assert torch.equal(fused["k"], k_before), "k itself must stay unrotated (only its cache rows are written)"
    written = fused["slot_mapping"][fused["slot_mapping"] >= 0]
    if kv_dtype is None:  # rows of padding tokens and unused slots stay NaN
        assert fused["k_cache"].isnan().flatten(2).all(-1).sum() == fused["k_cache"].shape[0] * PAGE - len(written)
    # And close to the torch references (HF rounding of the norm; float32 rotary).
    rope_store_kv_ref(**{n: t for n, t in ref.items() if n != "qkv"}, eps=1e-6)
    assert_close(fused["q"], ref["q"], dtype, "q")
    for name in ("k_cache", "v_cache"):
        got, want = fused[name], ref[name]
        if kv_dtype is not None:
            scale_got, scale_want = fused[name[0] + "_scale"], ref[name[0] + "_scale"]
            got = got.float() * scale_got.transpose(1, 2)[..., None]
            want = want.float() * scale_want.transpose(1, 2)[..., None]
        rows = got.reshape(-1, hkv, d)[written].float()
        want_rows = want.reshape(-1, hkv, d)[written].float()
        err = ((rows - want_rows).norm() / want_rows.norm()).item()
        tol = 5e-2 if kv_dtype is not None else REL_TOL[dtype]  # 8 bits: a code step where k rounded apart
        assert err < tol, f"{name} rel err {err:.2e} against the reference"


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"], ids=["float", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3-norm"])
@pytest.mark.parametrize("hq,hkv,d,dtype", [(4, 2, 64, torch.bfloat16), (6, 3, 32, torch.float32)],
                         ids=["gqa-bf16", "ragged-heads-fp32"])
def test_rope_store(hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, kv_dtype: str | None) -> None:
    check_rope_store(13, hq, hkv, d, dtype, kv_dtype, norm, "cpu")


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "q-norm"])
def test_rope_q_is_rope_store_kv_q(norm: bool) -> None:
    """q alone (a shared-KV layer's): the same q as the fused store's, bit for bit, and no cache written;
    the torch ops' q the same within a rounding."""
    from minfer.ops import RopeInputs, TorchOps

    case = _case(13, 4, 2, 32, torch.float32, None, norm, "cpu")
    fused, alone = _clone(case), _clone(case)
    _run_fused(fused)
    before = alone["qkv"].clone()
    rope_q(alone["q"], alone["positions"], alone["cos_sin_cache"], alone["q_norm_weight"], eps=1e-6)
    assert torch.equal(alone["q"], fused["q"])
    q_size = alone["q"].shape[1] * alone["q"].shape[2]
    assert torch.equal(alone["qkv"][:, q_size:], before[:, q_size:]), "k and v must stay untouched"
    assert alone["k_cache"].isnan().all(), "rope_q writes no cache"
    rope = RopeInputs(case["positions"], case["cos_sin_cache"], case["q_norm_weight"], case["k_norm_weight"])
    torch.testing.assert_close(TorchOps().rope_q(case["q"].clone(), rope), fused["q"], rtol=1e-5, atol=1e-5)


def test_rope_store_rejects_half_norm() -> None:
    case = _case(2, 2, 1, 16, torch.float32, None, True, "cpu")
    case["k_norm_weight"] = None
    with pytest.raises(ValueError, match="q_norm_weight and k_norm_weight"):
        _run_fused(case)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"], ids=["float", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3-norm"])
def test_rope_store_gpu(norm: bool, kv_dtype: str | None) -> None:
    check_rope_store(300, 16, 8, 128, torch.bfloat16, kv_dtype, norm, "cuda")


def test_float32_norm_weights_round_once_as_gemma():
    """Gemma's q/k norms keep ``1 + w`` in float32 and round once, after the weight: the fused kernel must equal
    the separate norm kernel (which rounds so) and differ from Llama's two roundings somewhere in bf16."""
    case = _case(24, 4, 2, 64, torch.bfloat16, None, True, "cpu")
    case["q_norm_weight"], case["k_norm_weight"] = (w.float() + 0.01 for w in (case["q_norm_weight"],
                                                                               case["k_norm_weight"]))
    fused, separate, llama = _clone(case), _clone(case), _clone(case)
    _run_fused(fused)
    _run_separate(separate)
    assert torch.equal(fused["qkv"], separate["qkv"]) and torch.equal(_bits(fused["k_cache"]), _bits(separate["k_cache"]))
    llama["q_norm_weight"], llama["k_norm_weight"] = (w.to(torch.bfloat16) for w in (case["q_norm_weight"],
                                                                                       case["k_norm_weight"]))
    _run_fused(llama)
    assert not torch.equal(fused["qkv"], llama["qkv"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_partial_rotary_as_qwen3_5(dtype: torch.dtype) -> None:
    """Qwen3.5's attention: a table of a quarter of the head's width rotates only those dims (pairs within them),
    after float32 (1 + w) norms. The fused kernel equals the separate steps bit for bit (the other dims: the norm
    alone); the torch ops' rotation is HF's ``apply_rotary_pos_emb`` exactly."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    from minfer.ops.torch_attention import rotate_hf

    case = _case(13, 4, 2, 64, dtype, None, True, "cpu", rotary_dim=16)
    case["q_norm_weight"], case["k_norm_weight"] = (w.float() for w in (case["q_norm_weight"], case["k_norm_weight"]))
    fused, separate, normed = _clone(case), _clone(case), _clone(case)
    _run_fused(fused)
    _run_separate(separate)
    assert torch.equal(fused["qkv"], separate["qkv"]) and torch.equal(_bits(fused["k_cache"]), _bits(separate["k_cache"]))
    normed_q = rms_norm(normed["q"], case["q_norm_weight"], 1e-6)
    assert torch.equal(fused["q"][..., 16:], normed_q[..., 16:]) and not torch.equal(fused["q"], normed_q)
    q, k, positions, table = case["q"], case["k"], case["positions"], case["cos_sin_cache"]
    cos, sin = (torch.cat([half, half], -1).to(dtype) for half in table[positions].chunk(2, dim=-1))
    for got, want in zip(rotate_hf(positions, table, q, k), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)
