"""Random-weight checkpoints of the model shapes in BENCHMARKS.md, written as real HF folders.

Benchmarks load them through the normal loader, so they measure exactly what a user's
checkpoint would run. The weights are random (no weights can be downloaded here): throughput
does not depend on their values, only on shapes and sequence lengths. The tensor names, shapes and
draws come from ``minfer.model.random_weights``. With ``load_format="dummy"`` the loader draws the same
tensors on the device itself, and only ``config.json`` is written (``write_shape_config``).
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minfer.model.registry import model_config
from minfer.model.random_weights import SEED, random_tensors, stored_dtype, tensor_shapes

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

_GEMMA3 = dict(max_position_embeddings=131072, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=1024, sliding_window_pattern=6,
               rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
               attn_logit_softcapping=None, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0)

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, bos_token_id=128000, eos_token_id=128001),
    # 70.6 B parameters, 141 GB in bf16: more than one H200 holds, so it runs with tensor parallelism (tp=4)
    "llama-3.1-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
                          max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                          rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, bos_token_id=128000, eos_token_id=128001),
    # mixtures of experts: 30.5 B parameters (3.3 B active per token), and 46.7 B (12.9 B active)
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                          tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-5, sliding_window=None, bos_token_id=1, eos_token_id=2),
    # Phi-4 (14.7 B): Phi3ForCausalLM with fused qkv_proj / gate_up_proj tensors, no rope scaling, no window
    "phi-4": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=5120, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=10, intermediate_size=17920, vocab_size=100352,
                  tie_word_embeddings=False, max_position_embeddings=16384, original_max_position_embeddings=16384,
                  rope_theta=250000.0, rope_scaling=None, rms_norm_eps=1e-5, sliding_window=None, hidden_act="silu",
                  bos_token_id=100257, eos_token_id=100265, pad_token_id=100349),
    # Mistral 7B v0.1: Llama's layout with a 4096-token sliding window on every layer
    "mistral-7b-v0.1": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False,
                            max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5,
                            sliding_window=4096, hidden_act="silu", bos_token_id=1, eos_token_id=2),
    # Gemma 3's language models (the text_config of the released multimodal checkpoints, in its own keys):
    # five 1024-token sliding layers to one global, a local rope base of 10 000 and a global one of 1e6 x8
    "gemma-3-12b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=3840,
                        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                        intermediate_size=15360, vocab_size=262208, tie_word_embeddings=True,
                        **_GEMMA3, query_pre_attn_scalar=256),
    "gemma-3-27b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=5376,
                        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        intermediate_size=21504, vocab_size=262208, tie_word_embeddings=True,
                        **_GEMMA3, query_pre_attn_scalar=168),
}
# gpt-oss: sinks, 128-token windows on alternate layers, YaRN, MXFP4 experts (the released format: random codes
# and scales), everything else bf16; 21 B (3.6 B active) and 117 B (5.1 B active)
_GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, num_attention_heads=64,
                num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_experts_per_tok=4,
                vocab_size=201088, tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=150000.0,
                rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 4096},
                sliding_window=128, swiglu_limit=7.0, attention_bias=True, rms_norm_eps=1e-5, hidden_act="silu",
                eos_token_id=[200002, 199999, 200012], pad_token_id=199999,
                quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
SHAPES["gpt-oss-20b"] = dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32)
SHAPES["gpt-oss-120b"] = dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128)
# Qwen3.5 dense: transformers 5's Qwen3_5TextConfig defaults: 3 Gated DeltaNet layers to 1 gated full attention
SHAPES["qwen3.5-9b"] = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=4096,
                            num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                            intermediate_size=12288, vocab_size=248320, tie_word_embeddings=False,
                            max_position_embeddings=32768, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                            linear_num_value_heads=32, full_attention_interval=4,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25}, eos_token_id=248044)
# Qwen3.5 MoE, the 35B-A3B layout: the same hybrid stack at hidden 2048, every MLP 256 routed experts (top 8) and a
# shared one (sizes as we read the released config; random weights)
SHAPES["qwen3.5-35b-a3b"] = dict(SHAPES["qwen3.5-9b"], architectures=["Qwen3_5MoeForCausalLM"],
                                 model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                                 num_attention_heads=16, num_key_value_heads=2, intermediate_size=512,
                                 num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                 shared_expert_intermediate_size=512, norm_topk_prob=True)
# The released Qwen3.5 checkpoints are multimodal: the same language model under ``text_config`` (random text weights)
SHAPES["qwen3.5-9b-mm"] = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5",
                               tie_word_embeddings=False, text_config={
                                   k: v for k, v in SHAPES["qwen3.5-9b"].items() if k != "architectures"}
                               | {"model_type": "qwen3_5_text"})
# The released Gemma 3 checkpoints (4B and up) are multimodal: the same language model under ``text_config`` of a
# ``Gemma3ForConditionalGeneration`` (random text weights only: minfer serves the text model).
for _size in ("12b", "27b"):
    SHAPES[f"gemma-3-{_size}-it"] = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                                         tie_word_embeddings=True, text_config={
                                             k: v for k, v in SHAPES[f"gemma-3-{_size}"].items() if k != "architectures"})


def shape_config(shape: str, dtype: torch.dtype = torch.bfloat16, layers: int | None = None,
                 overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``shape``, optionally scaled down: ``layers`` decoder layers, and any other
    config keys in ``overrides`` (e.g. ``hidden_size``) for a small stand-in with the shape's layout (a
    multimodal shape's go into its ``text_config``)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    cfg = dict(SHAPES[shape], torch_dtype=str(dtype).removeprefix("torch."))
    resized = dict(overrides or {}, **({} if layers is None else {"num_hidden_layers": layers}))
    if "text_config" in cfg:  # a multimodal config: the sizes are its language model's
        cfg["text_config"] = dict(cfg["text_config"], **resized)
    else:
        cfg.update(resized)
    return cfg


def plan_shards(cfg: dict[str, Any], element_bytes: int, shard_bytes: int) -> list[dict[str, tuple[int, ...]]]:
    """The checkpoint's tensors (name -> shape, in writing order) grouped into files of at most
    ``shard_bytes`` (a larger tensor gets a file of its own); nothing is allocated."""
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shp in tensor_shapes(model_config(cfg)).items():
        nbytes = math.prod(shp) * element_bytes
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shp
        size += nbytes
    return shards


def _is_whole(path: Path, names: dict[str, tuple[int, ...]], dtype: torch.dtype) -> bool:
    """Whether ``path`` is a complete safetensors file of exactly these tensors (a cut-off write is not:
    its header promises more bytes than the file has)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            if set(f.keys()) != set(names):
                return False
            for name, shp in names.items():
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != shp or sl.get_dtype() != _SAFETENSORS_DTYPES.get(stored_dtype(name, dtype)):
                    return False
        return path.stat().st_size >= _data_end(path)
    except Exception:  # noqa: BLE001 - unreadable header: not whole, write it again
        return False


def _data_end(path: Path) -> int:
    """The byte where the file's last tensor ends, from its header."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8"}


def write_shape_config(shape: str, out: Path, dtype: torch.dtype = torch.bfloat16, layers: int | None = None,
                       overrides: dict[str, Any] | None = None) -> Path:
    """Write only ``shape``'s ``config.json`` (``shape_config``) into ``out``: a folder for
    ``load_format="dummy"``, which draws the weights on the device while the model loads, so shapes
    larger than the disk can run (qwen3-30b-a3b: 61 GB, mixtral-8x7b: 93 GB). The shapes have no
    tokenizer; ``minfer bench`` sends token ids. Keep ``out`` apart from a full checkpoint's folder: a
    matching config.json marks that folder as complete."""
    cfg = shape_config(shape, dtype, layers, overrides)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_random_checkpoint(shape: str, out: Path, dtype: torch.dtype = torch.bfloat16,
                            shard_bytes: int = 2 << 30, seed: int = SEED, device: str = "cpu",
                            layers: int | None = None, overrides: dict[str, Any] | None = None) -> Path:
    """Write ``shape`` with N(0, 0.02) weights (norm weights 1) as sharded safetensors + index.
    ``device="cuda"`` draws them on the GPU (8B weights: seconds instead of a CPU minute; other values).
    ``layers`` / ``overrides``: a scaled-down version (``shape_config``).

    The files are written one at a time, each as soon as its tensors are drawn, so host memory holds
    at most one file's tensors (``shard_bytes``, 2 GiB) whatever the model's size (llama-3.1-70b: 141 GB).
    ``config.json`` is written last: a folder that has it is complete, and is reused when it matches. A write
    that was cut off resumes: a file of this plan that is already whole is kept (its tensors are still
    drawn, unsaved, so the later files get the same values as in one uninterrupted write)."""
    cfg = shape_config(shape, dtype, layers, overrides)
    config = model_config(cfg)
    if config.torch_dtype != dtype:  # random_tensors draws in the config's dtype
        raise ValueError(f"dtype must be one of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out  # already written
    (out / "config.json").unlink(missing_ok=True)  # incomplete until the end
    plan = plan_shards(cfg, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    drawn = random_tensors(config, device, seed)  # the dummy load's draws, in the plan's order
    fnames = [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    for old in out.glob("model-*-of-*.safetensors"):  # another plan's files (another size): disk space
        if old.name not in fnames:
            old.unlink()
    weight_map = {}
    for fname, names in zip(fnames, plan):
        whole = _is_whole(out / fname, names, dtype)
        tensors = {}
        for name, t in itertools.islice(drawn, len(names)):  # drawn even for a kept file: the generator moves on
            assert name in names, f"the plan and the draws disagree on the order at {name}"
            if not whole:
                tensors[name] = t.cpu()
        if not whole:
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
        weight_map |= {name: fname for name in names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def shape_checkpoint(shape: str, checkpoint_dir: Path, load_format: str = "auto", layers: int | None = None) -> Path:
    """The folder ``minfer bench --shape`` and ``bench-serve --launch --shape`` load: with ``load_format="dummy"``
    only the config (``write_shape_config``, into ``<shape>-dummy``), otherwise the whole random-weight
    checkpoint, drawn on the GPU when there is one. ``layers``: a scaled-down stand-in (``<shape>-<N>l``)."""
    name = shape if layers is None else f"{shape}-{layers}l"
    if load_format == "dummy":  # a folder of its own: a matching config.json marks a full checkpoint as complete
        return write_shape_config(shape, checkpoint_dir / f"{name}-dummy", layers=layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return write_random_checkpoint(shape, checkpoint_dir / name, layers=layers, device=device)
