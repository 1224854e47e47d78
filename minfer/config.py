"""Configuration dataclasses: what the model is (ModelConfig) and how the engine runs it (EngineConfig).

Both are validated once, at construction, so a bad value fails before any memory is allocated and
never in the middle of a batch. Field names follow vLLM so a vLLM user needs no dictionary.
Each EngineConfig field carries its help text (and its allowed values) in its metadata:
``minfer.engine_args`` turns them into the command-line flags, so a knob is declared only here.

torch is imported inside the functions that need it: the CLI builds its parser from this module,
and ``minfer --help`` should not pay the seconds that importing torch takes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer.structured_outputs import DEFAULT_LIMITS, StructuredOutputsLimits
from minfer.spec_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from minfer.kv_events_config import KVEventsConfig

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16", "fp16": "float16"}


def torch_dtype(name: str) -> "torch.dtype":
    """The ``torch.dtype`` of one of DTYPE_NAMES."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
    return getattr(torch, name)


@dataclass(slots=True)
class ModelConfig:
    """A checkpoint's shape and settings, read from its HF ``config.json`` by its model family
    (``minfer.model.registry.model_config``: each family's ``read_config`` passes ``from_hf`` the fields
    that are its own, such as q/k/v bias, per-head q/k norms or the MoE layout)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Sampling settings the checkpoint's generation_config.json recommends (SamplingParams names), used
    # where a request gives none (vLLM's generation_config="auto").
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # config.json's quantization_config as written (minfer.model.quantization reads it)
    quantization_config: dict[str, Any] | None = None
    # Mixture of experts: experts per MoE layer, experts per token, each expert's
    # MLP width, whether the top-k weights are renormalised to sum to one, and which layers are MoE.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # Per-layer attention kind as HF names it ('full_attention', 'sliding_attention'); empty: every layer
    # alike (windowed when ``sliding_window`` is set).
    layer_types: tuple[str, ...] = ()
    # A family's own settings beyond these fields (Gemma's soft-caps, scalars, rope bases...), read by its
    # ``read_config`` and used by its layers.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_head_dim(self) -> int:
        """The largest attention head size of any layer (what the kernels must support): ``head_dim``, or the
        largest of ``extra["layer_head_dims"]`` for a family whose layers differ (Gemma 4's global layers)."""
        return max((self.head_dim, *self.extra.get("layer_head_dims", ())))

    def layer_window(self, layer: int) -> int:
        """The attention window of ``layer`` (0: the whole context)."""
        if not self.sliding_window:
            return 0
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], **family: Any) -> "ModelConfig":
        """The fields every family reads alike from ``config.json`` (``cfg``), with ``family``'s fields on top."""
        archs = cfg.get("architectures") or []
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        # transformers 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("llama3", "linear", "longrope", "yarn", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear, longrope, yarn")
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
            if kind == "longrope":
                scaling = _longrope(scaling, cfg)
        window = cfg.get("sliding_window")
        dtype_name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
        fields_read = dict(
            architecture=archs[0] if archs else "",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=False,
            qk_norm=False,
            sliding_window=int(window) if window else None,
            layer_types=tuple(cfg.get("layer_types") or ()),
            torch_dtype=torch_dtype(dtype_name if dtype_name in DTYPE_NAMES else "float32"),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            quantization_config=cfg.get("quantization_config"),
        )
        return cls(**{**fields_read, **family})

    def add_generation_config(self, model_dir: Path) -> "ModelConfig":
        """``generation_config.json``'s end-of-sequence ids and sampling defaults, when the folder has one."""
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
            self.eos_token_ids = tuple(dict.fromkeys(self.eos_token_ids + _as_ids(gen.get("eos_token_id"))))
            self.sampling_defaults = sampling_defaults(gen)
        return self


# generation_config.json key -> SamplingParams field, as vLLM reads them
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams defaults a generation_config.json sets (as vLLM, ``do_sample`` is not read)."""
    return {field: generation_config[key] for key, field in _GENERATION_KEYS.items()
            if generation_config.get(key) is not None}


def _longrope(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """A longrope ``rope_scaling`` completed as HF reads it: the top-level ``original_max_position_embeddings``
    (Phi-3 keeps it there) before the dict's own, and ``factor`` (which sets the attention factor) defaulting
    to ``max_position_embeddings`` over it."""
    missing = [key for key in ("short_factor", "long_factor") if not scaling.get(key)]
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if missing or not original:
        raise ValueError(f"longrope rope_scaling needs short_factor, long_factor and original_max_position_embeddings; "
                         f"missing: {missing + ([] if original else ['original_max_position_embeddings'])}")
    factor = scaling.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings", 2048)) / int(original)
    return {**scaling, "original_max_position_embeddings": int(original), "factor": float(factor)}


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# 'auto' stores K/V in the model dtype; the others are 8-bit with a scale per token and KV head.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
_KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name for e4m3

QUANTIZATION_METHODS = ("fp8",)
LOAD_FORMATS = ("auto", "dummy")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's runner names ('draft' is speculative_config's)
SCHEDULING_POLICIES = ("fcfs", "prefill-first", "kv-predict")  # engine/sched_policy.py


def _knob(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field whose metadata holds its flag's help text and allowed values (see minfer.engine_args)."""
    metadata = {"help": help} if choices is None else {"help": help, "choices": choices}
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class EngineConfig:
    """Every knob of the engine, with vLLM's names and defaults.

    ``num_kv_blocks`` sizes the cache exactly; otherwise ``kv_cache_memory_bytes`` does, and
    without it the cache takes ``gpu_memory_utilization`` of the GPU (on the CPU: room for max_num_seqs
    sequences of max_model_len tokens, capped by half the available memory, its pages touched as
    they fill).
    """

    model: str | None = _knob(None, "local HF folder or hub id (default: the built-in model)")
    tokenizer: str | None = _knob(None, "tokenizer folder or hub id (default: the model's)")
    dtype: str = _knob("auto", "weights and activations; auto: the checkpoint's on a GPU, float32 on the CPU "
                       "(aliases: bf16, fp16, half, fp32, float)", DTYPE_CHOICES)
    device: str = _knob("auto", "auto: cuda when a GPU is present", DEVICES)
    seed: int = _knob(0, "seeds the draws of requests that bring no seed of their own")
    max_model_len: int | None = _knob(None, "longest prompt + output in tokens (default: the model's context)")
    max_num_seqs: int = _knob(256, "most sequences in one step")
    # As vLLM's offline LLM uses on large-memory GPUs. A step that carries prompt chunks runs eagerly,
    # one Python launch per kernel, and at 8192 those launches took longer than the GPU's work
    # (workload A, H200: 31 ms of host launch for ~20 ms of kernels per step); 16384 halves the count.
    max_num_batched_tokens: int = _knob(16384, "most tokens (prompt chunks + decodes) in one step")
    scheduling_policy: str = _knob("prefill-first", "which waiting prompts a step admits", SCHEDULING_POLICIES)
    block_size: int = _knob(16, "tokens per KV-cache block (a power of two up to 256)")
    gpu_memory_utilization: float = _knob(0.9, "share of the GPU's memory the engine may take, KV cache included")
    kv_cache_memory_bytes: int | None = _knob(None, "KV cache size in bytes (overrides gpu_memory_utilization; "
                                              "CPU default: max_num_seqs x max_model_len tokens, at most half the free memory)")
    num_kv_blocks: int | None = _knob(None, "exact number of KV blocks (overrides both KV sizes)")
    enable_prefix_caching: bool = _knob(True, "reuse the KV blocks of a prompt prefix seen before")
    disable_hybrid_kv_cache_manager: bool = _knob(
        False, "give every layer a block table over the whole context, even the sliding-window layers of a model "
        "that mixes windows (by default they keep only their window's blocks: engine/kv_groups.py)")
    enforce_eager: bool = _knob(False, "no CUDA graphs: every step launches its kernels from Python")
    async_scheduling: bool = _knob(True, "launch step N+1 before step N completes (host/GPU overlap; see "
                                   "engine/llm_engine.py)")
    attention_backend: str = _knob("auto", "auto: triton on a GPU where the shapes fit, torch otherwise",
                                   ATTENTION_BACKENDS)
    kv_cache_dtype: str = _knob("auto", "auto: the model dtype; the others are 8-bit with a scale per token "
                                "and KV head (alias: fp8 = fp8_e4m3)", KV_CACHE_DTYPES)
    quantization: str | None = _knob(None, "fp8: quantize a bf16/fp16 checkpoint's linear layers to FP8 while it loads "
                                     "(a scale per output channel); FP8 checkpoints (compressed-tensors, block FP8) "
                                     "are detected from config.json without it", QUANTIZATION_METHODS)
    tensor_parallel_size: int = _knob(1, "GPUs (on the CPU: processes) the model is sharded over; under torchrun, "
                                      "its WORLD_SIZE")
    data_parallel_size: int = _knob(1, "engine replicas (processes, tensor_parallel_size GPUs each) behind a balancer")
    data_parallel_rank: int = _knob(0, "this replica's index in [0, data_parallel_size), set by the launcher")
    generation_config: str = _knob("auto", "auto: the model's generation_config.json supplies the default sampling "
                                   "settings of requests that give none; vllm: SamplingParams' own defaults",
                                   ("auto", "vllm"))
    runner: str = _knob("auto", "generate: text (LLM.generate, chat and completions); pooling: one vector per prompt "
                        "(LLM.embed, /v1/embeddings; engine/pooling.py); auto: generate", RUNNERS)
    skip_tokenizer_init: bool = _knob(False, "no tokenizer: prompts must be token ids (e.g. random-weight shapes)")
    revision: str | None = _knob(None, "branch, tag or commit of a hub model")
    download_dir: str | None = _knob(None, "where hub models are downloaded (default: the HF cache)")
    load_format: str = _knob("auto", "auto: the checkpoint's safetensors; dummy: random weights drawn on the device "
                             "as the model loads (normal x 0.02, norm weights 1, as minfer bench --shape writes "
                             "them), so the folder needs only config.json (and the tokenizer's files unless "
                             "skipped): benchmarks of shapes too big for the disk", LOAD_FORMATS)
    # Bounds on a request's structured-outputs constraint, checked before jsonschema or xgrammar reads it
    # (minfer.structured_limits.StructuredOutputsLimits): a 400 naming the flag past them.
    structured_outputs_max_bytes: int = _knob(DEFAULT_LIMITS.max_bytes, "structured outputs: most bytes of a "
                                              "schema, grammar, regex or choice list")
    structured_outputs_max_depth: int = _knob(DEFAULT_LIMITS.max_depth, "structured outputs: deepest nesting of "
                                              "a schema's objects and arrays ($refs followed), or of a grammar's "
                                              "or regex's brackets")
    structured_outputs_max_nodes: int = _knob(DEFAULT_LIMITS.max_nodes, "structured outputs: most objects and "
                                              "arrays in a schema")
    structured_outputs_max_enum_entries: int = _knob(DEFAULT_LIMITS.max_enum_entries, "structured outputs: most "
                                                     "enum values and consts in a schema, or choices")
    structured_outputs_max_rules: int = _knob(DEFAULT_LIMITS.max_rules, "structured outputs: most rules in an "
                                              "EBNF grammar")
    structured_outputs_max_regex_length: int = _knob(DEFAULT_LIMITS.max_regex_length, "structured outputs: most "
                                                     "characters in a regex, a schema's pattern or "
                                                     "patternProperties key")
    speculative_config: SpeculativeConfig | None = _knob(
        None, "speculative decoding, vLLM's dictionary as JSON: method ngram (num_speculative_tokens, "
        "prompt_lookup_min, prompt_lookup_max), draft_model (model, num_speculative_tokens); "
        f"disable_by_batch_size (default {DEFAULT_DISABLE_BY_BATCH_SIZE}): no speculation in a step of that many "
        "sequences or more")
    enable_lora: bool = _knob(False, "serve LoRA adapters (PEFT format) beside the base model: a request names one "
                              "with lora_request, or on the server by its model name")
    max_loras: int = _knob(1, "LoRA: adapters resident on the device at once (the most distinct ones in a step)")
    max_lora_rank: int = _knob(16, "LoRA: the largest adapter rank accepted (every slot is this wide)")
    max_cpu_loras: int | None = _knob(None, "LoRA: adapters kept loaded in host memory (default max_loras)")
    structured_outputs_compile_timeout: float = _knob(30.0, "structured outputs: seconds a grammar may take to "
                                                      "compile (in its compiler process, which is killed past "
                                                      "them); the request then fails naming this flag")
    kv_events_config: KVEventsConfig | None = _knob(None, "prefix-cache block events for a prefix-aware router, "
                                                    "vLLM's JSON (enable_kv_cache_events, endpoint, topic, ...)")

    def __post_init__(self) -> None:
        self.structured_outputs_limits()  # checks them
        self.speculative_config = spec = SpeculativeConfig.parse(self.speculative_config)
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if spec is not None and spec.method != "ngram":
            tp = spec.draft_tensor_parallel_size
            if tp is not None and tp != self.tensor_parallel_size:
                raise ValueError(f"speculative_config.draft_tensor_parallel_size ({tp}) must equal "
                                 f"tensor_parallel_size ({self.tensor_parallel_size})")
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        for name, allowed in (("dtype", DTYPE_CHOICES), ("device", DEVICES), ("attention_backend", ATTENTION_BACKENDS),
                              ("generation_config", ("auto", "vllm")), ("runner", RUNNERS),
                              ("scheduling_policy", SCHEDULING_POLICIES)):
            _check_choice(name, getattr(self, name), allowed)
        self.runner = "generate" if self.runner == "auto" else self.runner  # every registered model generates
        if self.runner == "pooling" and (self.tensor_parallel_size > 1 or self.speculative_config or self.enable_lora):
            raise ValueError("runner='pooling' runs without tensor_parallel_size > 1, speculative_config, enable_lora")
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        self.kv_cache_dtype = _KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_int("seed", self.seed, 0)
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        _check_int("max_loras", self.max_loras, 1, 256)
        _check_int("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras)
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        _check_int("data_parallel_rank", self.data_parallel_rank, 0, self.data_parallel_size - 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        _check_int("block_size", self.block_size, 1, 256)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        timeout = self.structured_outputs_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_compile_timeout must be a number of seconds > 0, got {timeout!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs room for its decode token"
            )
        if self.device == "cuda" and not _cuda_available():
            raise ValueError("device='cuda' but no CUDA GPU is available; use device='cpu' or 'auto'")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword arguments, naming any unknown one together with the allowed names."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; allowed: {sorted(names)}")
        return cls(**kwargs)

    def structured_outputs_limits(self) -> StructuredOutputsLimits:
        """The ``structured_outputs_max_*`` fields as the limits object the checks take."""
        return StructuredOutputsLimits(**{f.name: getattr(self, "structured_outputs_" + f.name)
                                          for f in fields(StructuredOutputsLimits)})

    def resolved_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, model_config: ModelConfig) -> "torch.dtype":
        if self.dtype != "auto":
            return torch_dtype(self.dtype)
        return model_config.torch_dtype if self.resolved_device().type == "cuda" else torch_dtype("float32")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

