"""LLM: the offline API — ``LLM(model=...).generate(prompts, SamplingParams(...))`` as in vLLM."""
from __future__ import annotations

import dataclasses
import time
import weakref
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from tqdm.auto import tqdm

from minfer.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, run_beam_search
from minfer.config import EngineConfig
from minfer.engine.dp.engine import DataParallelLLMEngine
from minfer.engine.gc_heap import heap_frozen
from minfer.engine.llm_engine import LLMEngine
from minfer.engine.processor import PromptType
from minfer.lora.request import LoRARequest
from minfer.outputs import RequestOutput, RequestOutputKind
from minfer.pooling_outputs import EmbeddingRequestOutput
from minfer.pooling_params import PoolingParams
from minfer.reasoning import grammar_gate, parse_whole, reasoning_parser_class
from minfer.sampling_params import SamplingParams


def builtin_model_path() -> Path:
    """The small Python-code model shipped inside the package (trained by ``minfer train``)."""
    return Path(str(resources.files("minfer") / "assets" / "builtin-model"))


class LLM:
    """An engine plus a blocking ``generate``: all prompts are batched continuously until done.

    ``LLM()`` with no model loads the built-in model. Every engine argument of ``EngineConfig``
    (vLLM's names) is accepted as a keyword; an unknown or invalid one fails here.

    An LLM ends with ``shutdown()``, at the end of a ``with LLM(...) as llm:`` block, or when its last
    reference goes: its tensor-parallel workers stop and the process leaves their process group, so another
    LLM (tensor-parallel or not) can run in the same process.

    ``data_parallel_size=N``: N engine replicas, each in a process of its own with its own GPUs (``engine/dp/``); the
    prompts are spread over them by the balancer and the outputs come back in input order; ``shutdown()`` stops them.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``task``: vLLM's older name for the runner (``task="embed"`` is ``runner="pooling"``)."""
        if "task" in kwargs:
            kwargs["runner"] = runner_of_task(kwargs.pop("task"), kwargs.get("runner", "auto"))
        config = EngineConfig.from_kwargs(model=str(model or builtin_model_path()), **kwargs)
        engine_class = LLMEngine if config.data_parallel_size == 1 else DataParallelLLMEngine
        self.llm_engine: LLMEngine | DataParallelLLMEngine | None = engine_class(config, RequestOutputKind.FINAL_ONLY)
        self._counter = 0
        # A finalizer rather than __del__: it holds the engine, not the LLM, runs once however the LLM goes
        # (a reference count reaching zero, a collection, interpreter exit), and shutdown() can run it early.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave their process group, stop the grammar threads, and drop
        the engine (its weights and KV cache go with it). Idempotent; generating afterwards is an error."""
        self._finalizer()
        self.llm_engine = None

    @property
    def _engine(self) -> LLMEngine | DataParallelLLMEngine:
        if self.llm_engine is None:
            raise RuntimeError("this LLM has been shut down (shutdown() or the end of its `with` block); "
                               "create a new LLM to generate again")
        return self.llm_engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no SamplingParams: the model's generation_config.json
        settings (temperature, top_p, top_k, min_p, repetition_penalty) over SamplingParams' defaults."""
        return self._engine.processor.default_sampling_params()

    def get_tokenizer(self) -> Any:
        return self._engine.tokenizer

    def get_stats(self) -> dict[str, int | str]:
        return self._engine.get_stats()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``: the LoRA adapter every
        prompt runs through, or one per prompt (None: the base model; needs ``enable_lora=True``)."""
        return self._generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType], *,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (``outputs.embedding``: a list of floats), on an LLM built with
        ``runner="pooling"``; the prompts batch through the scheduler as prefills. ``pooling_params``: one for every
        prompt or one each (``dimensions``: a Matryoshka model's cut; ``normalize``: the model's default unless set)."""
        engine = self._engine
        if engine.pooler is None:
            raise ValueError("LLM.embed needs an LLM built with runner='pooling' (or task='embed'); this one generates")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = list(pooling_params) if isinstance(pooling_params, (list, tuple)) else \
            [pooling_params or PoolingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling_params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                if not isinstance(p, PoolingParams):
                    raise TypeError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
                ids.append(str(self._counter))
                self._counter += 1
                engine.add_processed_request(engine.processor.process(ids[-1], prompt, p))
        except Exception:
            for rid in ids:  # one bad prompt rejects the call and leaves nothing queued
                engine.abort_request(rid)
            raise
        return [EmbeddingRequestOutput.from_base(out) for out in self._run(ids, use_tqdm)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` with HF's semantics (``minfer.beam_search``): per prompt, its ``beam_width``
        sequences, best first. Each round is one batch of one-token requests down ``generate``'s path, their
        prompts (prompt + beam) sharing KV blocks through the prefix cache."""
        engine, tok = self._engine, self.get_tokenizer()
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        searches = []
        for prompt in prompts:
            _, ids = engine.processor.tokenize(prompt)
            max_total = engine.processor.check_prompt(ids, params.max_tokens)  # a max_tokens past the context: cut
            searches.append(BeamSearch(ids, params, engine.eos_token_ids, max_total - len(ids)))

        def step(beams: list[list[int]], step_params: SamplingParams) -> list[dict[int, float]]:
            outs = self._generate([{"prompt_token_ids": b} for b in beams], step_params, False,
                                  lora_request=lora_request)
            return [out.outputs[0].logprobs[0] for out in outs]

        run_beam_search(searches, step)
        return [s.output(tok.decode if tok is not None else None) for s in searches]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter ahead of its requests (False: loaded already)."""
        return self._engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self._engine.list_loras())

    def _generate(self, prompts: PromptType | Sequence[PromptType],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
                  reasoning: str | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """``generate``; ``reasoning``: the reasoning parser's name, whose end of reasoning structured outputs wait
        for (``grammar_gate``)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        engine = self._engine
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                ids.append(str(self._counter))
                self._counter += 1
                request = engine.processor.process(ids[-1], prompt, p, lora_request=lora)
                if reasoning is not None and p.structured_outputs is not None:
                    request.grammar_after = grammar_gate(engine.tokenizer, request.prompt_token_ids, reasoning)
                engine.add_processed_request(request)
        except Exception:
            for rid in ids:  # one bad prompt rejects the call and leaves nothing queued
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, reasoning_parser: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation (``tools``: OpenAI-style function specs
        the template shows the model; ``chat_template_kwargs``: more template variables, e.g. gpt-oss's
        ``reasoning_effort``), then generate; for calls that must parse, constrain the output with
        ``SamplingParams(structured_outputs=...)``. ``reasoning_parser`` (``qwen3``, ``deepseek_r1``,
        ``gpt_oss``: the server's ``--reasoning-parser``) moves each completion's reasoning to
        ``reasoning_content`` and leaves the answer alone in ``text`` (checked before anything is generated);
        structured outputs then constrain the answer only, from the end of the reasoning on, as the server does.
        ``gpt_oss`` reads harmony's special-token markers, so its completions are decoded with them kept
        (``skip_special_tokens=False``) and the parser takes them out; a function call is not in ``text`` (the
        server's tool-call parser reads calls; offline, decode ``token_ids``). ``lora_request``: as ``generate``'s,
        one for every conversation or one each."""
        parser = reasoning_parser_class(reasoning_parser) if reasoning_parser is not None else None
        if parser is not None and parser.needs_special_tokens:
            sampling_params = dataclasses.replace(sampling_params or self.get_default_sampling_params(),
                                                  skip_special_tokens=False)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or use generate()")
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, tools=tools, **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        outputs = self._generate(prompts, sampling_params, use_tqdm, reasoning=reasoning_parser,
                                 lora_request=lora_request)
        if parser is not None:
            for completion in (c for out in outputs for c in out.outputs):
                reasoning, content = parse_whole(parser(), completion.text)
                completion.reasoning_content, completion.text = reasoning, content or ""
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self._engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            with heap_frozen():  # no full collection walks the model's objects mid-run (engine/gc_heap.py)
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            generated += sum(len(c.token_ids) for c in out.outputs)
                            bar.update(1)
                            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.0f} out tok/s")
        except BaseException:
            for rid in request_ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]


def runner_of_task(task: str, runner: str) -> str:
    """The runner vLLM's older ``task`` argument names ('embed' or 'embedding': pooling; 'generate'); 'auto' leaves
    ``runner`` as it is. A task minfer does not run, or one that contradicts ``runner``, is refused."""
    tasks = {"auto": runner, "generate": "generate", "embed": "pooling", "embedding": "pooling"}
    if task not in tasks:
        raise ValueError(f"task must be one of {sorted(tasks)}, got {task!r}")
    if runner not in ("auto", tasks[task]):
        raise ValueError(f"task={task!r} asks for runner={tasks[task]!r}, but runner={runner!r} was given")
    return tasks[task]
