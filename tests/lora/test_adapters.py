"""LoRA adapters as PEFT writes them: parsed tensors and scales equal PEFT's own modules' updates, every
unsupported feature refused by name, the slot table's LRU and contents, and tensor-parallel shares that
recombine to the whole product. Adapters are written by the peft library itself on a tiny Llama."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minfer.config import ModelConfig
from minfer.distributed import TensorParallel
from minfer.lora import (NO_SLOT, PROJECTIONS, BaseLinears, LoRAAdapterError, LoRARequest, LoRASlots, LoRASlotsError,
                         load_adapter, shard_weights)
from minfer.lora import slots as slots_module

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 2, 32, 48, 4, 2, 8
BASE = BaseLinears(LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM)


def _hf_config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                    num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)


def _peft_model(seed: int = 0, **lora: object):
    """A tiny random Llama wrapped by PEFT with non-zero A and B (PEFT's default zeroes B)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_hf_config())
    lora = {"r": 4, "lora_alpha": 8, "target_modules": list(PROJECTIONS), "init_lora_weights": False} | lora
    return peft.get_peft_model(model, peft.LoraConfig(**lora))


def _write(folder: Path, seed: int = 0, **lora: object) -> tuple[Path, object]:
    model = _peft_model(seed, **lora)
    model.save_pretrained(str(folder))
    return folder, model


def _projection(decoder, layer: int, module: str):
    """A projection of an HF ``LlamaModel`` (PEFT's wrapper of it, in a PeftModel)."""
    block = decoder.layers[layer]
    return getattr(block.self_attn if module in PROJECTIONS[:4] else block.mlp, module)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three adapters of ranks 4, 8 and 2 (q_proj only) on the same base, written once for the slot tests."""
    root = tmp_path_factory.mktemp("lora")
    return {"r4": _write(root / "r4", seed=1, r=4, lora_alpha=8)[0],
            "r8": _write(root / "r8", seed=2, r=8, lora_alpha=32)[0],
            "q2": _write(root / "q2", seed=3, r=2, lora_alpha=2, target_modules=["q_proj"])[0]}


def _request(adapters: dict[str, Path], name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(adapters[name]))


# --- requests and the base description ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [(dict(lora_name="", lora_int_id=1, lora_path="p"), "lora_name"),
                                           (dict(lora_name="a", lora_int_id=0, lora_path="p"), "lora_int_id"),
                                           (dict(lora_name="a", lora_int_id=True, lora_path="p"), "lora_int_id"),
                                           (dict(lora_name="a", lora_int_id=1, lora_path=""), "lora_path")])
def test_request_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoRARequest(**kwargs)


def test_base_linears_match_hf_and_model_config() -> None:
    hf = transformers.LlamaForCausalLM(_hf_config())
    base = BaseLinears.from_model_config(ModelConfig.from_hf(_hf_config().to_dict()))
    assert base == BASE
    for (layer, module), (n_in, n_out) in base.shapes().items():
        linear = _projection(hf.model, layer, module)
        assert (linear.in_features, linear.out_features) == (n_in, n_out)
    assert len(base.shapes()) == LAYERS * 7


# --- parsing against PEFT ------------------------------------------------------------------------------------

@pytest.mark.parametrize("lora", [dict(r=4, lora_alpha=8), dict(r=8, lora_alpha=16),
                                  dict(r=4, lora_alpha=16, use_rslora=True),
                                  dict(r=8, lora_alpha=8, rank_pattern={"down_proj": 2, "layers.1.self_attn.q_proj": 6},
                                       alpha_pattern={"v_proj": 3})])
def test_tensors_and_scaling_equal_peft(tmp_path: Path, lora: dict) -> None:
    folder, model = _write(tmp_path / "a", seed=5, **lora)
    adapter = load_adapter(folder, BASE, max_lora_rank=8)
    assert set(adapter.modules) == set(BASE.shapes())
    x = torch.randn(5, INTERMEDIATE)
    for (layer, module), weights in adapter.modules.items():
        peft_module = _projection(model.base_model.model.model, layer, module)
        assert torch.equal(weights.lora_a, peft_module.lora_A["default"].weight.detach())
        assert torch.equal(weights.lora_b, peft_module.lora_B["default"].weight.detach())
        assert weights.scaling == pytest.approx(peft_module.scaling["default"], rel=1e-12)
        inputs = x[:, :peft_module.in_features]
        with torch.no_grad():
            expected = peft_module(inputs) - peft_module.base_layer(inputs)
        torch.testing.assert_close(weights.delta(inputs), expected, rtol=1e-5, atol=1e-5)
    assert adapter.rank == max(w.rank for w in adapter.modules.values())
    if lora.get("use_rslora"):
        assert adapter.modules[(0, "q_proj")].scaling == pytest.approx(16 / math.sqrt(4))
    if "rank_pattern" in lora:
        assert adapter.modules[(0, "down_proj")].rank == 2 and adapter.modules[(1, "q_proj")].rank == 6
        assert adapter.modules[(0, "q_proj")].rank == 8
        assert adapter.modules[(1, "v_proj")].scaling == pytest.approx(3 / 8)


def test_bin_weights_load_like_safetensors(tmp_path: Path) -> None:
    folder, _ = _write(tmp_path / "a", r=4)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    (folder / "adapter_model.safetensors").unlink()
    torch.save(tensors, folder / "adapter_model.bin")
    adapter = load_adapter(folder, BASE, max_lora_rank=4)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    assert torch.equal(adapter.modules[(1, "up_proj")].lora_b, tensors[key])


# --- refusals ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lora, match", [
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    (dict(target_modules=["embed_tokens"]), "embedding"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="lora_only"), "bias"),
    (dict(target_modules=r".*(q_proj|lm_head)"), "lm_head"),
])
def test_unsupported_features_are_refused_by_name(tmp_path: Path, lora: dict, match: str) -> None:
    folder, _ = _write(tmp_path / "a", **lora)
    with pytest.raises(LoRAAdapterError, match=match):
        load_adapter(folder, BASE, max_lora_rank=8)


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_dora_tensors_refused_even_when_the_config_hides_them(tmp_path: Path) -> None:
    folder, _ = _write(tmp_path / "a", use_dora=True, target_modules=["q_proj"])
    _edit_config(folder, use_dora=False)
    with pytest.raises(LoRAAdapterError, match="DoRA magnitude"):
        load_adapter(folder, BASE, max_lora_rank=8)


def test_rank_above_the_limit(tmp_path: Path) -> None:
    folder, _ = _write(tmp_path / "a", r=8)
    with pytest.raises(LoRAAdapterError, match=r"rank 8, above max_lora_rank=4"):
        load_adapter(folder, BASE, max_lora_rank=4)


def test_wrong_shapes(tmp_path: Path) -> None:
    folder, _ = _write(tmp_path / "a", r=4)
    wider = BaseLinears(LAYERS, HIDDEN * 2, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM)
    with pytest.raises(LoRAAdapterError, match=r"wrong shapes for model\.layers\.0\.\w+\.\w+"):
        load_adapter(folder, wider, max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match=r"base model does not have \(it has 1 layers\)"):
        load_adapter(folder, BaseLinears(1, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM), max_lora_rank=8)
    moe = BaseLinears(LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, moe_layers=(1,))
    with pytest.raises(LoRAAdapterError, match="layer 1 is a MoE layer"):
        load_adapter(folder, moe, max_lora_rank=8)
    _edit_config(folder, r=2)  # the tensors say 4
    with pytest.raises(LoRAAdapterError, match="wrong shapes"):
        load_adapter(folder, BASE, max_lora_rank=8)


def test_missing_files_and_halves(tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        load_adapter(tmp_path / "nowhere", BASE, max_lora_rank=8)
    folder, _ = _write(tmp_path / "a", r=4)
    _edit_tensors(folder, lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"))
    with pytest.raises(LoRAAdapterError, match=r"model\.layers\.0\.mlp\.up_proj has lora_A but no lora_B"):
        load_adapter(folder, BASE, max_lora_rank=8)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="missing weights"):
        load_adapter(folder, BASE, max_lora_rank=8)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match="missing adapter_config.json"):
        load_adapter(folder, BASE, max_lora_rank=8)


# --- the slot table ------------------------------------------------------------------------------------------

def _slots(max_loras: int = 2, max_rank: int = 8, **kw: object) -> LoRASlots:
    return LoRASlots(BASE, max_loras, max_rank, torch.float32, "cpu", **kw)


def _slot_delta(slots: LoRASlots, slot: int, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    """What the kernels compute for one shard from the stacks: x A^T (scale B)^T over the padded rank."""
    fused, shard = slots_module.SHARD_OF[module]
    stack = slots.stacks[(layer, fused)]
    first = sum(stack.shard_sizes[:shard])
    return x @ stack.a_stack[slot, shard].T @ stack.b_stack[slot, first:first + stack.shard_sizes[shard]].T


def test_stack_layout_and_contents(adapters: dict[str, Path]) -> None:
    slots = _slots(max_loras=2, max_rank=8)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    assert slots.stacks[(0, "qkv")].a_stack.shape == (2, 3, 8, HIDDEN)
    assert slots.stacks[(0, "qkv")].b_stack.shape == (2, q + 2 * kv, 8)  # the shards' rows stacked
    assert slots.stacks[(0, "qkv")].shard_sizes == (q, kv, kv)
    assert slots.stacks[(1, "gate_up")].a_stack.shape == (2, 2, 8, HIDDEN)
    assert slots.stacks[(1, "o")].a_stack.shape == (2, 1, 8, q)
    assert slots.stacks[(1, "down")].b_stack.shape == (2, HIDDEN, 8)
    r4, q2 = _request(adapters, "r4", 4), _request(adapters, "q2", 2)
    assert slots.activate([r4, None, q2, r4]) == [0, NO_SLOT, 1, 0]
    full = load_adapter(adapters["r4"], BASE, 8)
    x = torch.randn(3, INTERMEDIATE)
    for (layer, module), weights in full.modules.items():
        inputs = x[:, :weights.lora_a.shape[1]]
        torch.testing.assert_close(_slot_delta(slots, 0, layer, module, inputs), weights.delta(inputs))
    # the rank-2 q-only adapter: zero past its rank, and every other module zero
    qkv = slots.stacks[(0, "qkv")]
    assert qkv.a_stack[1, 0, :2].abs().sum() > 0 and not qkv.a_stack[1, 0, 2:].any()
    q_rows = HEADS * HEAD_DIM
    assert not qkv.a_stack[1, 1:].any() and not qkv.b_stack[1, q_rows:].any() and not qkv.b_stack[1, :, 2:].any()
    assert all(not s.a_stack[1].any() and not s.b_stack[1].any() for k, s in slots.stacks.items() if k[1] != "qkv")


def test_lru_eviction_and_pinning(adapters: dict[str, Path]) -> None:
    slots = _slots(max_loras=2, max_cpu_loras=3)
    a, b, c = (_request(adapters, n, i) for n, i in (("r4", 1), ("r8", 2), ("q2", 3)))
    assert slots.activate([a]) == [0] and slots.activate([b]) == [1]
    slots.activate([a])  # a is now the most recent, b the least
    assert slots.activate([c]) == [1]  # b's slot
    assert (slots.slot_of(1), slots.slot_of(2), slots.slot_of(3)) == (0, None, 1)
    # a is the least recently used now, but the batch pins it: c goes
    assert slots.activate([a, b]) == [0, 1] and slots.slot_of(3) is None
    before = {k: (s.a_stack.clone(), s.b_stack.clone()) for k, s in slots.stacks.items()}
    with pytest.raises(LoRASlotsError, match="max_loras=2"):
        slots.activate([a, b, c])
    assert (slots.slot_of(1), slots.slot_of(2)) == (0, 1)
    assert all(torch.equal(s.a_stack, before[k][0]) and torch.equal(s.b_stack, before[k][1])
               for k, s in slots.stacks.items())


def test_cpu_cache_bound(adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    real = slots_module.load_adapter
    monkeypatch.setattr(slots_module, "load_adapter", lambda path, *a: reads.append(Path(path).name) or real(path, *a))
    slots = _slots(max_loras=1, max_cpu_loras=2)
    a, b, c = (_request(adapters, n, i) for n, i in (("r4", 1), ("r8", 2), ("q2", 3)))
    for request in (a, b, a, c):
        slots.activate([request])
    assert reads == ["r4", "r8", "q2"]  # a came back from the CPU cache
    assert list(slots.list_adapters()) == [1, 3]  # b was the least recently used
    slots.activate([b])
    assert reads[-1] == "r8" and list(slots.list_adapters()) == [3, 2]
    assert slots.add(a) is True and list(slots.list_adapters()) == [2, 1]  # c goes; b runs
    with pytest.raises(ValueError, match="max_cpu_loras"):
        _slots(max_loras=2, max_cpu_loras=1)


def test_swap_out_and_back_is_identical(adapters: dict[str, Path]) -> None:
    slots = _slots(max_loras=2, max_cpu_loras=2)
    a, b, c = (_request(adapters, n, i) for n, i in (("r4", 1), ("r8", 2), ("q2", 3)))
    slot = slots.activate([a])[0]
    snapshot = {k: (s.a_stack[slot].clone(), s.b_stack[slot].clone()) for k, s in slots.stacks.items()}
    slots.activate([b, c])  # a leaves its slot and the CPU cache
    assert slots.slot_of(1) is None and 1 not in slots.list_adapters()
    slots.activate([b])
    back = slots.activate([a])[0]  # evicts c; a is read again from its folder, into c's slot
    assert back != slot
    for k, s in slots.stacks.items():
        assert torch.equal(s.a_stack[back], snapshot[k][0]) and torch.equal(s.b_stack[back], snapshot[k][1])


def test_refused_loads_and_removal_leave_clean_state(adapters: dict[str, Path], tmp_path: Path) -> None:
    slots = _slots(max_loras=2, max_rank=4)
    a = _request(adapters, "r4", 1)
    slots.activate([a])
    with pytest.raises(LoRAAdapterError, match="max_lora_rank=4"):
        slots.activate([a, _request(adapters, "r8", 2)])
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        slots.activate([LoRARequest("gone", 3, str(tmp_path / "gone"))])
    assert list(slots.list_adapters()) == [1] and slots.slot_of(2) is None and slots.slot_of(3) is None
    assert all(not s.a_stack[1].any() for s in slots.stacks.values())
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter"):
        slots.activate([LoRARequest("other", 1, str(adapters["q2"]))])
    assert slots.remove(1) is True and slots.remove(1) is False
    assert slots.slot_of(1) is None and slots.list_adapters() == {}
    assert all(not s.a_stack.any() and not s.b_stack.any() for s in slots.stacks.values())


# --- tensor parallelism --------------------------------------------------------------------------------------

def test_tp_shares_recombine(adapters: dict[str, Path]) -> None:
    full = load_adapter(adapters["r8"], BASE, 8)
    x = torch.randn(3, INTERMEDIATE)
    ranks = [TensorParallel(rank=r, size=2) for r in range(2)]
    for (layer, module), weights in full.modules.items():
        inputs = x[:, :weights.lora_a.shape[1]]
        parts = []
        for tp in ranks:
            share = shard_weights(weights, module, BASE, tp)
            start, length = BASE.tp_range(module, tp)
            if module in ("o_proj", "down_proj"):  # row-parallel: A's columns, a partial sum each
                assert share.lora_b.shape == weights.lora_b.shape and share.lora_a.shape[1] == length
                parts.append(share.delta(inputs[:, start:start + length]))
            else:
                assert share.lora_a.shape == weights.lora_a.shape and share.lora_b.shape[0] == length
                parts.append(share.delta(inputs))
        whole = sum(parts) if module in ("o_proj", "down_proj") else torch.cat(parts, dim=1)
        torch.testing.assert_close(whole, weights.delta(inputs), rtol=1e-5, atol=1e-5)


def test_tp_slots_and_replicated_kv_heads(adapters: dict[str, Path]) -> None:
    """Slots on each of 4 ranks (2 KV heads: each held by 2 ranks) give that rank's rows of the output."""
    full = load_adapter(adapters["r4"], BASE, 8)
    x = torch.randn(3, HIDDEN)
    request = _request(adapters, "r4", 7)
    for rank in range(4):
        tp = TensorParallel(rank=rank, size=4)
        slots = LoRASlots(BASE, 1, 8, torch.float32, tp=tp)
        slot = slots.activate([request])[0]
        assert slots.stacks[(0, "qkv")].shard_sizes == (HEAD_DIM, HEAD_DIM, HEAD_DIM)
        for module in ("q_proj", "k_proj", "v_proj"):
            start, length = BASE.tp_range(module, tp)
            expected = full.modules[(1, module)].delta(x)[:, start:start + length]
            torch.testing.assert_close(_slot_delta(slots, slot, 1, module, x), expected)
        kv_start, _ = BASE.tp_range("k_proj", tp)
        assert kv_start == (rank // 2) * HEAD_DIM
