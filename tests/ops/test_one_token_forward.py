"""The fused one-token forward (minfer/ops/one_token.py) against the model's plain forward on the
Triton ops (interpreter on CPU), and both against the torch ops, on tiny models of each family (Qwen3.5's hybrid
layers: their recurrent state in slot 0 of a state cache)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minfer.model.registry import load_model_config
from minfer.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from minfer.engine.state_cache import allocate_state_cache, state_layers
from minfer.model.loader import build_model
from minfer.ops import AttentionMetadata, select_ops
from minfer.ops import one_token
from conftest import MOE, make_moe_checkpoint

BLOCK = 16
PROMPT = [5, 17, 42, 9, 100, 3, 77]


def _meta(slots: list[int], ctx: int, num_decodes: int, device: str = "cpu") -> AttentionMetadata:
    """One sequence in block 0: a decode (one token) or a prompt chunk of ``len(slots)`` tokens."""
    q = torch.tensor([0, len(slots)], dtype=torch.int32, device=device)
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)
    lens = torch.tensor([ctx], dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=[torch.tensor(slots, device=device)], block_tables=[table], context_lens=lens,
        num_decodes=num_decodes, block_size=BLOCK, prefill_query_start_loc=None if num_decodes else q,
        prefill_block_tables=None if num_decodes else [table], prefill_context_lens=None if num_decodes else lens,
        max_prefill_query_len=0 if num_decodes else len(slots), context_lens_host=[ctx],
        query_lens_host=[len(slots)], state_slots=torch.tensor([0], dtype=torch.int32, device=device),
        has_state=torch.tensor([num_decodes > 0], device=device), query_start_loc=q)


def _decode_hidden(path, backend: str, fused: bool | None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   load_format: str = "auto") -> torch.Tensor:
    """Prefill PROMPT with the plain forward, then one decode step: through the ops' step forward
    (``fused=None``), or explicitly the fused one-token forward / the plain model forward."""
    cfg = load_model_config(path)
    ops = select_ops(backend, torch.device(device), BLOCK, cfg.head_dim)
    model = build_model(path, cfg, dtype, torch.device(device), 64, ops, load_format=load_format)
    layers = model.attention_layers()
    allocate_kv_cache(layers, KVCacheSpec.for_layers(layers, BLOCK, dtype, hybrid=False), 2, torch.device(device))
    allocate_state_cache(state_layers(model), 1, torch.device(device))
    n = len(PROMPT)
    with torch.no_grad():
        model(torch.tensor(PROMPT, device=device), torch.arange(n, device=device), _meta(list(range(n)), n, 0, device))
        forward = ops.model_forward(model) if fused is None else \
            one_token.LAYOUTS[model.fused_one_token](model) if fused else model
        hidden = forward(torch.tensor([11], device=device), torch.tensor([n], device=device),
                         _meta([n], n + 1, 1, device))
        return model.compute_logits(hidden)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_moe_checkpoint(root / name, name, tokenizer=False) for name in MOE}


# plain, bias, q/k norms, Gemma's, Qwen3.5's hybrid layers; the MoE blocks (the norm in the router's launch):
# Qwen3-MoE's (and its dense layers between), Mixtral's, gpt-oss's (biased router, sinks), Qwen3.5-MoE's shared expert
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_5", "gpt_oss", "qwen3_5_moe",
                                  "qwen3_moe", "qwen3_moe_mixed", "mixtral"])
def test_one_token_forward_matches_plain_forward_and_torch_ops(checkpoints, moe_checkpoints, arch):
    path = (moe_checkpoints if arch in MOE else checkpoints)[arch]
    fused = _decode_hidden(path, "triton", True)
    plain = _decode_hidden(path, "triton", False)
    torch_ops = _decode_hidden(path, "torch", None)
    assert _rel(fused, plain) < 1e-5, "fused one-token forward vs the plain forward on the Triton ops"
    assert _rel(fused, torch_ops) < 1e-4, "Triton ops vs torch ops"
    assert torch.equal(fused.argmax(-1), torch_ops.argmax(-1))


def test_step_forward_takes_the_fused_path_exactly_at_one_token(checkpoints, monkeypatch):
    calls = []
    real = one_token.gemv_rms_norm
    monkeypatch.setattr(one_token, "gemv_rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = checkpoints["llama3"]
    stepped = _decode_hidden(path, "triton", None)
    assert len(calls) == 2 * load_model_config(path).num_hidden_layers  # the decode, not the prefill
    assert torch.equal(stepped, _decode_hidden(path, "triton", True))
    cfg = load_model_config(path)
    torch_ops = select_ops("torch", torch.device("cpu"), BLOCK, cfg.head_dim)
    model = build_model(path, cfg, torch.float32, torch.device("cpu"), 64, torch_ops)
    assert torch_ops.model_forward(model) is model  # the torch ops have no fused forward


def test_gemma_takes_its_own_fused_layout_and_gemma4_none(checkpoints):
    """Gemma 2/3 decode through the Gemma layout's fused launches (GeGLU in down's prologue); Gemma 4's layers
    (per-layer inputs, shared KV) run the model's own forward; gpt-oss's are Llama's."""
    for arch, layout in (("gemma3", one_token.GemmaOneTokenForward), ("gemma4", None),
                         ("llama3", one_token.OneTokenForward), ("gpt_oss", one_token.OneTokenForward),
                         ("qwen3_5", one_token.Qwen3_5OneTokenForward)):
        cfg = load_model_config(checkpoints[arch])
        ops = select_ops("triton", torch.device("cpu"), BLOCK, cfg.max_head_dim)
        model = build_model(checkpoints[arch], cfg, torch.float32, torch.device("cpu"), 64, ops)
        forward = ops.model_forward(model)
        if layout is None:
            assert forward is model
        else:
            assert type(forward.one_token) is layout


@pytest.mark.gpu
def test_qwen3_5_9b_layers_fused_one_token_forward_on_gpu(tmp_path):
    """Four of Qwen3.5-9B's layers (three Gated DeltaNet, one gated attention; dummy weights) and its LM head: in
    bfloat16, the fused one-token forward is as close to the float32 plain forward as the bfloat16 plain one (cuBLAS
    GEMMs, the layers' own norms and gates) is."""
    from minfer.benchmark.shapes import write_shape_config

    path = write_shape_config("qwen3.5-9b", tmp_path, layers=4)
    run = dict(device="cuda", load_format="dummy")
    ref = _decode_hidden(path, "triton", False, dtype=torch.float32, **run)
    fused = _decode_hidden(path, "triton", True, dtype=torch.bfloat16, **run)
    plain = _decode_hidden(path, "triton", False, dtype=torch.bfloat16, **run)
    errors = _rel(fused, ref), _rel(plain, ref)
    assert errors[0] <= 1.25 * errors[1] + 1e-3 and errors[0] < 5e-2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layers", [("qwen3-30b-a3b", 2), ("gpt-oss-20b", 2), ("qwen3.5-35b-a3b", 4)])
def test_moe_shapes_fused_one_token_forward_on_gpu(tmp_path, shape, layers):
    """The MoE layouts compiled (the router's launch keeping the normed row, the decode kernels under PDL; gpt-oss's
    MXFP4 experts) on the real shapes' layers and LM head (dummy weights), in float32, where top-k ties between the
    two paths' summation orders are too rare to move a token's experts: the fused one-token forward against the
    plain forward."""
    from minfer.benchmark.shapes import write_shape_config

    path = write_shape_config(shape, tmp_path, layers=layers)
    run = dict(device="cuda", load_format="dummy", dtype=torch.float32)
    fused, plain = _decode_hidden(path, "triton", True, **run), _decode_hidden(path, "triton", False, **run)
    assert _rel(fused, plain) < 1e-4


@pytest.mark.parametrize("arch,flag,fused", [("llama3", True, True), ("qwen2", True, True), ("gpt_oss", True, True),
                                             ("mixtral", True, True), ("qwen3", True, False), ("llama3", False, False)])
def test_rope_store_in_the_qkv_launch_matches_the_plain_forward(checkpoints, moe_checkpoints, monkeypatch, arch,
                                                                flag, fused):
    """``MINFER_FUSED_ROPE_STORE`` (on by default): the qkv launch rotates q and k and stores K/V
    (``gemv_epilogue.py``) for Llama attention without q/k norms (biases, sinks and windows too); Qwen3's norms keep
    the separate kernel, as does every layer with the flag off. The decode step, which attends over the K/V its qkv
    launches stored, gives the plain forward's logits."""
    path = (moe_checkpoints if arch in MOE else checkpoints)[arch]
    monkeypatch.setattr(one_token, "FUSED_ROPE_STORE", flag)
    used = []
    real = one_token.gemv_rms_norm
    monkeypatch.setattr(one_token, "gemv_rms_norm",
                        lambda *a, **k: used.append(k.get("rope_store") is not None) or real(*a, **k))
    got = _decode_hidden(path, "triton", True)
    assert any(used) == fused
    assert _rel(got, _decode_hidden(path, "triton", False)) < 1e-5
