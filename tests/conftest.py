"""Shared fixtures: tiny random-weight HF checkpoints of every supported architecture.

Weights are drawn with a large scale so that logits are far from ties and greedy decoding is a
sharp test of exactness against HF transformers.
"""
from __future__ import annotations

import glob
import inspect
import os
from pathlib import Path

# Triton reads TRITON_INTERPRET when its modules load, and transformers may import Triton early:
# without a GPU, switch the interpreter on before anything else is imported.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
# Under pytest-xdist (the README's `pytest -n 2`) each worker takes its share of the cores, so that two workers on a
# two-core machine do not each run two-thread kernels against the other's.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

VOCAB = 320
_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Hello, world! " * 3,
    "import os\nimport sys\nfor i in range(10):\n    print(i, os.getcwd(), sys.argv)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n",
]

ARCHS: dict[str, dict] = {
    # Llama 3.x style: GQA, llama3 rope scaling, untied head
    "llama3": dict(arch="LlamaForCausalLM", model_type="llama", tie=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    # TinyLlama / Llama 2 style with linear rope scaling, tied embeddings
    "llama_linear": dict(arch="LlamaForCausalLM", model_type="llama", tie=True,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral": dict(arch="MistralForCausalLM", model_type="mistral", tie=False, sliding_window=None),
    "qwen2": dict(arch="Qwen2ForCausalLM", model_type="qwen2", tie=True),
    "qwen3": dict(arch="Qwen3ForCausalLM", model_type="qwen3", tie=True, head_dim=32),
    # sliding windows that end mid-page (16-token blocks), shorter than the longer prompts: every layer
    # (Mistral), and the layers from max_window_layers on (Qwen2)
    "mistral_sw": dict(arch="MistralForCausalLM", model_type="mistral", tie=False, sliding_window=21),
    "qwen2_sw": dict(arch="Qwen2ForCausalLM", model_type="qwen2", tie=True, use_sliding_window=True,
                     sliding_window=21, max_window_layers=1),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint, a window on every layer that ends mid-page
    "phi3": dict(arch="Phi3ForCausalLM", model_type="phi3", tie=False, sliding_window=21, pad_token_id=None),
    # longrope within its original length (max_model_len = 64 = original_max_position_embeddings): the short
    # factors and an explicit attention factor; the long factors are tested beyond it (test_engine_vs_hf.py)
    "phi3_longrope": dict(arch="Phi3ForCausalLM", model_type="phi3", tie=False, pad_token_id=None,
                          max_position_embeddings=64, original_max_position_embeddings=64,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "attention_factor": 1.2,
                                           "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5, 7.5],
                                           "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]}),
    # Gemma 2: sliding then global (HF's default pattern), soft-caps where they bend the scores and logits, a
    # scale (query_pre_attn_scalar) that is not head_dim's, head_dim * heads != hidden. Both Gemmas untied: with
    # the tied head and sqrt(hidden)-scaled embeddings this tiny model repeats its last token whatever attention
    # does (tests/model/test_gemma.py covers the tied head)
    "gemma2": dict(arch="Gemma2ForCausalLM", model_type="gemma2", tie=False, head_dim=32,
                   sliding_window=21, query_pre_attn_scalar=64, attn_logit_softcapping=10.0,
                   final_logit_softcapping=15.0),
    # Gemma 3: q/k norms, sliding, sliding, global (sliding_window_pattern 3), a local and a (linearly scaled)
    # global rope base
    "gemma3": dict(arch="Gemma3ForCausalLM", model_type="gemma3_text", tie=False, num_hidden_layers=3, head_dim=32,
                   sliding_window=21, sliding_window_pattern=3, query_pre_attn_scalar=64,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Gemma 4: S G S | S G, the last two reading the K/V of layers 2 and 1 (num_kv_shared_layers: the last
    # earlier layer of their type, not the first) with double-wide MLPs; global layers with their own head size
    # (32 vs 16), one KV head, keys as values and a partial (proportional, 1/4) rope; per-layer inputs (PLE);
    # soft-capped logits. Untied: a tied head makes this tiny model repeat its last token.
    "gemma4": dict(arch="Gemma4ForCausalLM", model_type="gemma4_text", tie=False, num_hidden_layers=5, head_dim=16,
                   global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=21,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                "full_attention"], num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                   vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True, final_logit_softcapping=30.0),
    # gpt-oss: sinks, windowed / full layers alternating (window 21: prompts pass it mid-page), q/k/v/o biases,
    # YaRN (factor 4 over 128 positions: the blend band lies inside the 8 frequencies), a biased router, top-2 of 4
    # experts whose SwiGLU clamps at 1.5 (the tiny model's gate/up values pass it)
    "gpt_oss": dict(arch="GptOssForCausalLM", model_type="gpt_oss", tie=False, head_dim=16, sliding_window=21,
                    num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}),
    # Qwen3.5: two Gated DeltaNet layers (two key heads shared by four value heads, a 4-tap conv), then a gated
    # full-attention layer with (1 + w) q/k norms and a quarter of its 32 head dims rotated
    "qwen3_5": dict(arch="Qwen3_5ForCausalLM", model_type="qwen3_5_text", tie=False, num_hidden_layers=3,
                    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention", "linear_attention", "full_attention"]),
    # Qwen3.5-MoE: those layers, each with a sparse block of top-2 of 4 experts (renormalised softmax weights) and a
    # shared expert scaled by its sigmoid gate
    "qwen3_5_moe": dict(arch="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text", tie=False, num_hidden_layers=3,
                        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4,
                        layer_types=["linear_attention", "linear_attention", "full_attention"], num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


def make_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer trained on a few lines, saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(str(out))


def make_checkpoint(out: Path, name: str, *, scale: float = 2.0, layers: int = 2, seed: int = 0,
                    dtype: torch.dtype = torch.float32, max_positions: int = 512, kv_heads: int = 2,
                    hidden: int = 64, intermediate: int = 128) -> Path:
    """Write a tiny random-weight checkpoint of architecture ``name`` (see ARCHS) with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = ARCHS[name]
    kw = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
              tie_word_embeddings=spec["tie"], bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6)
    kw |= {key: value for key, value in spec.items() if key not in ("arch", "model_type", "tie")}
    config = AutoConfig.for_model(spec["model_type"], **kw)
    config.architectures = [spec["arch"]]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("sinks"):  # gpt-oss: logits of the scores' size, so that a sink weighs
                p.copy_(2.0 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5 * (2.0 if "embed" in pname else 1.0))
        for bname, b in model.named_buffers():
            if bname.endswith("layer_scalar"):  # Gemma 4's per-layer output scale: a checkpoint buffer
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(root / name, name) for name in ARCHS}


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by HF transformers (its own KV cache) and each step's logits."""
    model = _hf_model(model_dir)
    # transformers renamed past_key_values to cache (5.2x); accept either
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, steps = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1].float()
            steps.append(logits)
            tokens.append(int(logits.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{name: out[name]})
    return tokens, steps


_HF_CACHE: dict[str, object] = {}


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _HF_CACHE[key]


def assert_greedy_match(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], tie_gap: float = 1e-3) -> None:
    """Tokens must be equal; where they part, the reference's top two logits must be a near-tie."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < tie_gap, f"diverged at output token {i}: ours {a}, HF {b}, HF top-2 gap {gap:.4g}"
            return
    assert len(ours) == len(ref), f"length differs: {len(ours)} vs {len(ref)}"


def assert_same_outputs(a: list, b: list, tol: float = 1e-4) -> None:
    """Two runs' outputs (e.g. tp=2 against tp=1): the same tokens, the same top-logprob tokens, logprobs
    within ``tol``."""
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert lx.keys() == ly.keys()
            assert max(abs(lx[t] - ly[t]) for t in lx) < tol


# Mixture-of-experts checkpoints (tests/engine/test_moe.py and its gpu twin)
MOE = {
    "qwen3_moe": dict(model_type="qwen3_moe", arch="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      head_dim=32),
    # every other layer dense, and top-k weights not renormalised
    "qwen3_moe_mixed": dict(model_type="qwen3_moe", arch="Qwen3MoeForCausalLM", num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                            decoder_sparse_step=2, mlp_only_layers=[], head_dim=16),
    "mixtral": dict(model_type="mixtral", arch="MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None),
}


def make_moe_checkpoint(out: Path, name: str, scale: float = 2.0, tokenizer: bool = True, **sizes) -> Path:
    """A tiny random MoE checkpoint of ``MOE[name]`` (``sizes`` override its dimensions), weights ~ scale /
    sqrt(fan-in): logits spread wide enough that greedy steps are rarely near-ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MOE[name])
    model_type, arch = spec.pop("model_type"), spec.pop("arch")
    dims = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512) | spec | sizes
    config = AutoConfig.for_model(model_type, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                                  rms_norm_eps=1e-6, **dims)
    config.architectures = [arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5 * (2.0 if "embed" in pname else 1.0))
    model.save_pretrained(str(out))
    if tokenizer:
        make_tokenizer(out)
    return out


def kv_settings(path, settings: dict) -> dict:
    """``settings`` with ``num_kv_blocks`` scaled by the model's KV groups: a hybrid cache's block is a page of
    one group's layers only, so the same memory holds that many times more blocks. The groups are the ones the
    engine makes of the model's own cache-owning layers (built on the meta device, without weights): layers
    of different shapes stay in one group, and a layer that reads another's cache (Gemma 4) owns none."""
    from minfer.engine.kv_cache import KVCacheSpec
    from minfer.model.registry import load_model_config, model_class
    from minfer.ops import TorchOps

    cfg = load_model_config(path)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32, cfg.max_position_embeddings, TorchOps())
    spec = KVCacheSpec.for_layers(model.attention_layers(), 16, torch.float32, max_model_len=cfg.max_position_embeddings)
    return dict(settings, num_kv_blocks=settings["num_kv_blocks"] * len(spec.kv_groups))
