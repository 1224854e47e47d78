"""The speculator an engine's ``speculative_config`` asks for (None without one), and its drafter (a draft model or
an EAGLE-3 head), which loads before the target's memory profile."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.engine.spec.speculator import Speculator

if TYPE_CHECKING:
    from minfer.engine.model_runner import ModelRunner
    from minfer.engine.spec.draft_model import DraftModel
    from minfer.engine.spec.eagle3 import Eagle3Drafter


def make_draft(config: EngineConfig, target: ModelConfig, max_model_len: int, device: torch.device,
               tp: TensorParallel = SINGLE) -> "DraftModel | Eagle3Drafter | None":
    """The drafter of method 'draft_model' or 'eagle3', its weights (this rank's shard) loaded; None for n-gram.
    Every tensor-parallel rank builds one, then its runner (which calls its ``prepare_target`` on the target
    model), then ``attach``es it, in that order."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "eagle3":
        from minfer.engine.spec.eagle3 import Eagle3Drafter

        return Eagle3Drafter(spec, config, target, max_model_len, device, tp)
    from minfer.engine.spec.draft_model import DraftModel

    return DraftModel(spec, config, target, max_model_len, device, tp)


def make_speculator(config: EngineConfig, runner: "ModelRunner", draft: "DraftModel | Eagle3Drafter | None"
                    ) -> Speculator | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if runner.state_layers:
        raise ValueError("speculative_config: models with recurrent layers (state_layers) cannot speculate yet: "
                         "a rejected draft would have to roll their state back")
    if draft is not None:
        draft.attach(runner)
    return Speculator(spec, draft)
