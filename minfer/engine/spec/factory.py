"""The speculator an engine's ``speculative_config`` asks for (None without one), and its draft model, which loads
before the target's memory profile."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.engine.spec.speculator import Speculator

if TYPE_CHECKING:
    from minfer.engine.model_runner import ModelRunner
    from minfer.engine.spec.draft_model import DraftModel


def make_draft(config: EngineConfig, target: ModelConfig, max_model_len: int, device: torch.device,
               tp: TensorParallel = SINGLE) -> "DraftModel | None":
    """The draft model of method 'draft_model', its weights (this rank's shard) loaded; None for the other
    methods. Every tensor-parallel rank builds one, then its runner, then ``attach``es it, in that order."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from minfer.engine.spec.draft_model import DraftModel

    return DraftModel(spec, config, target, max_model_len, device, tp)


def make_speculator(config: EngineConfig, runner: "ModelRunner", draft: "DraftModel | None") -> Speculator | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if runner.state_layers:
        raise ValueError("speculative_config: models with recurrent layers (state_layers) cannot speculate yet: "
                         "a rejected draft would have to roll their state back")
    if draft is not None:
        draft.attach(runner)
    return Speculator(spec, draft)
