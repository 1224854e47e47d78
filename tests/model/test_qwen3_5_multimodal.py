"""Qwen3.5's multimodal checkpoints serve their language model: tiny ``Qwen3_5ForConditionalGeneration`` and
``Qwen3_5MoeForConditionalGeneration`` written by transformers (a one-block vision tower beside the text model, and a
multi-token-prediction tensor as the released files carry) give the HF model's greedy tokens and logprobs on text
prompts; no tower or ``mtp.*`` tensor is read; experts stacked in one tensor (the released MoE files) load as the
per-expert tensors ``save_pretrained`` writes do, on every tensor-parallel rank."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_reads import record_reads
from conftest import VOCAB, assert_greedy_match, make_tokenizer
from minfer import LLM, SamplingParams
from minfer.distributed import TensorParallel
from minfer.model import loader
from minfer.model.registry import load_model_config
from minfer.ops import TorchOps

PROMPTS = [[5], [(i * 7) % 300 + 2 for i in range(30)]]
NEW = 8
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention"], max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
MTP = {"mtp.fc.weight": torch.ones(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)}


def _hf_class(kind: str):
    import transformers

    return getattr(transformers, "Qwen3_5ForConditionalGeneration" if kind == "dense"
                   else "Qwen3_5MoeForConditionalGeneration")


@pytest.fixture(scope="module", params=["dense", "moe"])
def multimodal(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """(the checkpoint folder, the HF model loaded from it)."""
    import transformers

    kind = request.param
    config_cls = transformers.Qwen3_5Config if kind == "dense" else transformers.Qwen3_5MoeConfig
    cfg = config_cls(text_config=TEXT | (MOE if kind == "moe" else {}), vision_config=VISION,
                     image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
                     vision_end_token_id=VOCAB - 4, tie_word_embeddings=False)
    cfg.architectures = [_hf_class(kind).__name__]
    torch.manual_seed(0)
    model = _hf_class(kind)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:  # the Gated DeltaNet's A_log and dt_bias
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 2.0 / p.shape[-1] ** 0.5 * (2.0 if "embed" in name else 1.0))
    out = tmp_path_factory.mktemp(f"qwen3_5_mm_{kind}")
    model.save_pretrained(str(out))
    file = out / "model.safetensors"
    save_file(load_file(str(file)) | MTP, str(file), metadata={"format": "pt"})  # as the released files carry
    make_tokenizer(out)
    return out, _hf_class(kind).from_pretrained(str(out), dtype=torch.float32).eval()


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The multimodal HF model's greedy continuation of a text prompt, with each step's logits."""
    tokens, steps = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(NEW):
            steps.append(out.logits[0, -1].float())
            tokens.append(int(steps[-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), use_cache=True, cache=out.cache)
    return tokens, steps


SCENARIOS = {"default": dict(num_kv_blocks=64),
             "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=2),  # chunks beside a decode
             "preempt": dict(num_kv_blocks=3, max_num_batched_tokens=6, max_num_seqs=4)}  # the longest just fits alone


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_text_model_matches_hf(multimodal, scenario):
    path, hf = multimodal
    llm = LLM(str(path), **SCENARIOS[scenario])
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = _hf_greedy(hf, prompt)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        for tok, entry, logits in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, ref_logits):
            assert abs(entry[tok] - float(logits.log_softmax(-1)[tok])) < 1e-4
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert (stats["num_preemptions"] > 0) == (scenario == "preempt")


def test_no_tower_or_mtp_tensor_is_read(multimodal, monkeypatch):
    path, _ = multimodal
    read = record_reads(monkeypatch)
    cfg = load_model_config(path)
    loader.build_model(path, cfg, torch.float32, torch.device("cpu"), 64, TorchOps())
    stored = list(load_file(str(path / "model.safetensors")))
    skipped = [k for k in stored if k.startswith(("model.visual.", "mtp."))]
    assert skipped and not set(skipped) & set(read)
    assert {k for k in stored if k.startswith("model.language_model.")} <= set(read)
    assert cfg.architecture.endswith("ForConditionalGeneration") and cfg.layer_types[2] == "full_attention"


@pytest.mark.parametrize("multimodal", ["moe"], indirect=True)
def test_stacked_experts_load_as_per_expert_ones(multimodal, tmp_path):
    """The released layout: ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up) and ``experts.down_proj``
    [E, H, I] per layer, in place of ``experts.N.{gate,up,down}_proj.weight``."""
    path, _ = multimodal
    cfg = load_model_config(path)
    tensors = load_file(str(path / "model.safetensors"))
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.language_model.layers.{layer}.mlp.experts."
        each = [[tensors[f"{p}{e}.{m}_proj.weight"] for e in range(cfg.num_experts)] for m in ("gate", "up", "down")]
        stacked[p + "gate_up_proj"] = torch.cat([torch.stack(each[0]), torch.stack(each[1])], dim=1)
        stacked[p + "down_proj"] = torch.stack(each[2])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    save_file(stacked, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for tp in (TensorParallel(0, 1), TensorParallel(1, 2)):
        a, b = (loader.build_model(folder, cfg, torch.float32, torch.device("cpu"), 64, TorchOps(), tp)
                for folder in (path, tmp_path))
        for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert torch.equal(x, y), name
