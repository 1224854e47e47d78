"""What a training run does (``TrainConfig``), apart from the loop that does it (``trainer.py``).

Kept free of torch so that ``minfer train``'s flags, generated from these defaults, cost nothing
to build: ``minfer --help`` imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from minfer.config import DTYPE_NAMES

HELDOUT_RULES = ("auto", "packages", "tail")
WARMUP_FRACTION = 0.1  # of the run, when --warmup is not given

if TYPE_CHECKING:
    from minfer.train.model import ModelConfig


@dataclass(slots=True)
class TrainConfig:
    out: Path
    paths: list[str] = field(default_factory=list)  # empty: the stdlib
    # Which documents are held out (validation loss): "packages" (the stdlib's email/json/tomllib packages and
    # their tests, see corpus.py), "tail" (the last ~5% of the text), or "auto": packages for the default
    # stdlib corpus, tail for a corpus of your own.
    heldout: str = "auto"
    # Defaults: the sweep's "d256-l8" (8.0M parameters, 15.8 MiB in bf16, 0.9895 held-out
    # bits/byte); the shipped model is its 4096-vocabulary, 9-layer sibling (TRAINING.md).
    vocab_size: int = 8192
    tokenizer: Path | None = None  # reuse this tokenizer folder instead of training one
    hidden_size: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 704
    rope_theta: float = 10000.0
    dropout: float = 0.1
    seq_len: int = 1024
    batch_size: int = 32
    steps: int = 2000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    # Warm-up steps; None: the first WARMUP_FRACTION of the run, which under --max-time is counted in time
    # as the decay is (200 steps of the default 2000; a fixed count would outlast a short or time-boxed run).
    warmup: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_windows: int = 64  # periodic evaluations use this many evenly spread windows
    device: str = "auto"
    seed: int = 0
    resume: bool = False
    max_time: float | None = None  # seconds of training, evaluations included
    dtype: str = "bfloat16"  # of the exported weights
    compile: bool = False
    quiet: bool = False
    stop_after: int | None = None  # pause here (checkpoint, no export); resume keeps schedule

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        for name in ("seq_len", "batch_size", "steps", "eval_every", "eval_windows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.heldout not in HELDOUT_RULES:
            raise ValueError(f"heldout must be one of {list(HELDOUT_RULES)}, got {self.heldout!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"max_time must be > 0 seconds, got {self.max_time}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")

    def model_config(self, vocab_size: int) -> ModelConfig:
        """Validates the shape (ModelConfig raises ValueError on a bad one)."""
        from minfer.train.model import ModelConfig
        from minfer.train.tokenizer import BOS_ID, EOS_ID, PAD_ID

        return ModelConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate_size,
            max_position_embeddings=self.seq_len, rope_theta=self.rope_theta,
            dropout=self.dropout, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
