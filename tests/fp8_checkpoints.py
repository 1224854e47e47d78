"""FP8 test checkpoints in the formats people download, from a tiny float checkpoint:
compressed-tensors' float-quantized format written by the compressed-tensors library itself, and the
block-FP8 layout of the official Qwen3-*-FP8 checkpoints (``weight_scale_inv`` per 128×128 block)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

E4M3_MAX = 448.0


def write_compressed_tensors(src: Path, out: Path, strategy: str = "channel", static_acts: bool = False) -> Path:
    """Quantize ``src``'s linear layers (lm_head ignored) with compressed-tensors and save them in its
    float-quantized format. ``strategy``: 'channel', 'tensor' or 'block' (128×128) weight scales;
    activations dynamic per token (per 128-group for blocks), or static per tensor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    block = strategy == "block"
    input_amax = _calibrate(model) if static_acts else {}
    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False, strategy=strategy,
                               block_structure=[128, 128] if block else None)
    if static_acts:
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="tensor")
    elif block:
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="group",
                                group_size=128)
    else:
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="float-quantized",
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.detach().float()
        if block:
            n, k = w.shape
            padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
            padded[:n, :k] = w
            amax = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128).abs().amax(dim=(1, 3))
        elif strategy == "tensor":
            amax = w.abs().amax().reshape(module.weight_scale.shape)
        else:
            amax = w.abs().amax(dim=1, keepdim=True)
        module.weight_scale.data.copy_((amax / E4M3_MAX).clamp(min=1e-8).to(module.weight_scale.dtype))
        if static_acts:
            module.input_scale.data.fill_(input_amax[module] / E4M3_MAX)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def write_tensor_fp8(src: Path, out: Path) -> Path:
    """vLLM's plain ``quant_method: fp8`` layout: e4m3 ``weight`` with one float32 ``weight_scale`` per
    tensor, activations dynamic."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    written = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            written[name] = w
            continue
        scale = (w.float().abs().amax() / E4M3_MAX).clamp(min=1e-8)
        written[name] = (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        written[name.replace(".weight", ".weight_scale")] = scale.reshape(1)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_block_fp8(src: Path, out: Path) -> Path:
    """The Qwen3-*-FP8 / DeepSeek layout: e4m3 ``weight`` and float32 ``weight_scale_inv`` per 128×128
    block (the dequantization factor), ``quant_method: fp8``, ``weight_block_size: [128, 128]``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    state = load_file(str(src / "model.safetensors"))
    written = {}
    for name, w in state.items():
        if not name.endswith("_proj.weight"):
            written[name] = w
            continue
        n, k = w.shape
        bn, bk = -(-n // 128), -(-k // 128)
        padded = torch.zeros(bn * 128, bk * 128)
        padded[:n, :k] = w.float()
        blocks = padded.view(bn, 128, bk, 128)
        scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-8)
        q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        written[name] = q.view(bn * 128, bk * 128)[:n, :k].contiguous()
        written[name.replace(".weight", ".weight_scale_inv")] = scale
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _calibrate(model: torch.nn.Module) -> dict[torch.nn.Module, float]:
    """Each linear layer's largest |input| over a few prompts: static activation scales' calibration."""
    amax: dict[torch.nn.Module, float] = {}

    def hook(module, args):
        amax[module] = max(amax.get(module, 0.0), float(args[0].abs().amax()))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.arange(2, 60).reshape(2, 29))
    for h in handles:
        h.remove()
    return amax


def write_dequantized(src: Path, out: Path) -> Path:
    """A float32 copy of a block-FP8 or per-tensor FP8 checkpoint with every weight dequantized
    (w = q * scale, exactly): HF transformers' float model on it is the reference an FP8 engine is
    measured against."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    state = load_file(str(src / "model.safetensors"))
    plain = {}
    for name, t in state.items():
        if name.endswith(("weight_scale_inv", "weight_scale")):
            continue
        stem = name[:-len(".weight")] if name.endswith(".weight") else None
        block, per_tensor = state.get(f"{stem}.weight_scale_inv"), state.get(f"{stem}.weight_scale")
        if block is not None:
            n, k = t.shape
            t = t.float() * block.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        elif per_tensor is not None:
            t = t.float() * per_tensor.float()
        plain[name] = t.float()
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def fake_quant_reference(model_dir: Path, block: bool, quantize_weights: bool = False) -> torch.nn.Module:
    """HF transformers' float32 model of ``model_dir`` computing as an FP8 engine does: every decoder
    linear layer's input rounded to e4m3 (scale per token, or per token and 128-column group), and with
    ``quantize_weights`` its weights rounded per output row (online FP8) first."""
    from transformers import AutoModelForCausalLM

    from minfer.model.quantization.fp8 import quantize_rows

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def round_input(module, args):
        x = args[0]
        parts = x.split(128, dim=-1) if block else (x,)
        out = []
        for part in parts:
            scale = (part.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
            out.append((part / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale)
        return (torch.cat(out, -1),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            module.register_forward_pre_hook(round_input)
            if quantize_weights:
                q, scale = quantize_rows(module.weight.data)
                module.weight.data = q.float() * scale[:, None]
    return model


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation without a KV cache (every step recomputes the sequence): the reference's
    tokens and each step's logits."""
    tokens, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            last = model(torch.tensor([tokens])).logits[0, -1].float()
            logits.append(last)
            tokens.append(int(last.argmax()))
    return tokens[len(prompt):], logits


def assert_same_distributions(fast: list, ref: list, prob_tol: float = 0.08, tie_gap: float = 0.3) -> None:
    """Two FP8 paths (``RequestOutput`` lists with top logprobs) agree: at each step while they have drawn
    the same tokens, the top tokens overlap, their probabilities differ by < ``prob_tol``, and the greedy
    token is the same unless the reference's top two are within ``tie_gap`` nats. Both round activations
    to e4m3 from values that differ by summation order (or, at batch 1, one path keeps them unrounded),
    so single values land an e4m3 step apart; a wrong scale or layout changes the distribution outright."""
    import math

    checked = 0
    for f_out, r_out in zip(fast, ref):
        for f, r in zip(f_out.outputs[0].logprobs, r_out.outputs[0].logprobs):
            ranked = sorted(r.items(), key=lambda kv: -kv[1])
            shared = [t for t, _ in ranked if t in f]
            assert len(shared) >= 2, (f, r)
            assert max(abs(math.exp(f[t]) - math.exp(r[t])) for t in shared) < prob_tol, (f, r)
            if ranked[0][1] - ranked[1][1] > tie_gap:
                assert max(f, key=f.get) == ranked[0][0], (f, r)
            checked += 1
            if max(f, key=f.get) != ranked[0][0]:
                break
    assert checked >= len(ref)
