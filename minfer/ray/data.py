"""Ray Data batch inference: ``ds.map_batches(LLMPredictor, fn_constructor_kwargs={...}, ...)``.

Ray Data builds one ``LLMPredictor`` per actor of its pool (``compute=ray.data.ActorPoolStrategy(size=N)``, or
``concurrency=N`` on older Ray), with the GPUs that ``num_gpus`` reserves for it (the engine's
``tensor_parallel_size``), then calls it on batch after batch. The engine is built once in ``__init__`` and each
batch is one ``LLM.generate`` call, so the rows of a batch share continuous batching and the prefix cache; a
larger ``batch_size`` keeps the engine fuller between batches.

A batch may come as numpy columns (``batch_format="numpy"``, Ray's default), a pandas DataFrame or a pyarrow
Table; the answer has the same form, with every input column kept and ``generated_text`` and
``num_generated_tokens`` added. This module does not import Ray: Ray imports it inside its actors.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from minfer.llm import LLM
from minfer.outputs import RequestOutput
from minfer.sampling_params import SamplingParams

INPUT_COLUMNS = ("prompt", "prompt_token_ids", "messages")  # text, token ids, a chat conversation


class LLMPredictor:
    """A callable class for ``Dataset.map_batches``: one engine per actor, one ``generate`` per batch.

    ``model``: a checkpoint folder or hub id as ``LLM`` takes it (None: the built-in model); every other keyword
    but the ones below is an engine argument (``tensor_parallel_size``, ``max_model_len``, ...), checked when the
    actor builds its ``LLM``. ``sampling_params``: a ``SamplingParams`` or its fields as a dict (a plain dict
    also reads well in a YAML job spec); None: the model's defaults. ``input_column``: which of ``prompt``
    (text), ``prompt_token_ids`` (token ids) and ``messages`` (a chat, rendered by the chat template) holds the
    prompts; None: the one of the three that the batch has. ``chat_template``: the template's text, for
    ``messages`` with a model whose tokenizer has none.
    """

    def __init__(self, model: str | None = None, sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                 input_column: str | None = None, chat_template: str | None = None, **engine_kwargs: Any) -> None:
        if input_column is not None and input_column not in INPUT_COLUMNS:
            raise ValueError(f"input_column must be one of {list(INPUT_COLUMNS)}, got {input_column!r}")
        if engine_kwargs.get("data_parallel_size", 1) != 1:
            raise ValueError("LLMPredictor runs one engine per actor: set Ray Data's actor pool size (compute="
                             "ray.data.ActorPoolStrategy(size=N)) instead of data_parallel_size")
        params = SamplingParams(**sampling_params) if isinstance(sampling_params, Mapping) else sampling_params
        if params is not None and params.n != 1:  # one row, one answer: the output columns hold one text a row
            raise ValueError(f"LLMPredictor writes one completion a row, so sampling_params.n must be 1, got "
                             f"{params.n}: repeat the rows (with different seeds) for several samples")
        self.llm = LLM(model, **engine_kwargs)
        self.sampling_params = params if params is not None else self.llm.get_default_sampling_params()
        self.input_column = input_column
        self.chat_template = chat_template

    def __call__(self, batch: Any) -> Any:
        """Generate for every row of ``batch``; the answer is the batch with the two output columns added."""
        column = self._input_column(batch)
        values = _column(batch, column)
        if column == "messages":
            outputs = self.llm.chat([_conversation(v) for v in values], self.sampling_params, use_tqdm=False,
                                    chat_template=self.chat_template) if values else []
        elif column == "prompt_token_ids":
            prompts: list[Any] = [{"prompt_token_ids": [int(t) for t in ids]} for ids in values]
            outputs = self.llm.generate(prompts, self.sampling_params, use_tqdm=False)
        else:
            outputs = self.llm.generate([str(p) for p in values], self.sampling_params, use_tqdm=False)
        return _with_columns(batch, _output_columns(outputs))

    def _input_column(self, batch: Any) -> str:
        names = _column_names(batch)
        if self.input_column is not None:
            if self.input_column not in names:
                raise ValueError(f"the batch has no {self.input_column!r} column (it has {names})")
            return self.input_column
        found = [c for c in INPUT_COLUMNS if c in names]
        if len(found) != 1:
            what = "none" if not found else f"{found}: pass input_column to choose"
            raise ValueError(f"LLMPredictor reads its prompts from one of the columns {list(INPUT_COLUMNS)}; the "
                             f"batch has {what} (its columns: {names})")
        return found[0]


def _output_columns(outputs: Sequence[RequestOutput]) -> dict[str, np.ndarray]:
    """The first (only) completion of each request: its text and how many tokens it took."""
    texts = np.empty(len(outputs), dtype=object)  # object: numpy's fixed-width strings would pad and copy
    texts[:] = [out.outputs[0].text for out in outputs]
    counts = np.array([len(out.outputs[0].token_ids) for out in outputs], dtype=np.int64)
    return {"generated_text": texts, "num_generated_tokens": counts}


def _column_names(batch: Any) -> list[str]:
    if isinstance(batch, Mapping):
        return list(batch)
    if hasattr(batch, "column_names"):  # pyarrow.Table
        return list(batch.column_names)
    if hasattr(batch, "columns"):  # pandas.DataFrame
        return [str(c) for c in batch.columns]
    raise TypeError(f"LLMPredictor takes numpy, pandas or pyarrow batches, got {type(batch).__name__}")


def _column(batch: Any, name: str) -> list[Any]:
    """A column's values as Python objects (a pyarrow list or struct column becomes lists and dicts)."""
    if hasattr(batch, "column_names"):
        return batch.column(name).to_pylist()
    return list(batch[name])


def _with_columns(batch: Any, columns: dict[str, np.ndarray]) -> Any:
    """``batch`` in its own form with ``columns`` added (a new object: Ray's zero-copy batches are read-only)."""
    if isinstance(batch, Mapping):
        return {**batch, **columns}
    if hasattr(batch, "append_column"):  # pyarrow.Table
        import pyarrow as pa

        for name, values in columns.items():
            batch = batch.append_column(name, pa.array(values.tolist()))
        return batch
    return batch.assign(**columns)  # pandas.DataFrame


def _conversation(messages: Any) -> list[dict[str, Any]]:
    """One chat as the template takes it. Ray stores a column of messages as Arrow structs, which gives every
    message every key any message had (a missing one as None) and numpy arrays for lists: undo both."""
    if isinstance(messages, str):
        raise ValueError("a `messages` value must be a list of {'role': ..., 'content': ...} dicts, got a string")
    return [{key: _plain(value) for key, value in dict(message).items() if value is not None} for message in messages]


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value
