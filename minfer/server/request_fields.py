"""The request fields both OpenAI endpoints share, and the rules every request field follows.

Requests are validated in strict mode (``RequestModel``), so ``"max_tokens": "5"`` or ``"stream": 1`` is a
400 naming the field rather than a silent coercion, and every range check happens in the request
models, in the HTTP handler, before anything reaches the engine thread. Every string, at any depth, must be valid unicode
(``Text``, ``check_unicode``): a lone UTF-16 surrogate (``"\\ud800"`` in JSON) would make the tokenizer,
the chat template or the response's own encoding raise later. Names beyond OpenAI's (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ...) are vLLM's, which the ``openai`` client sends
through ``extra_body``.

A field that would change the output is either honoured or refused: ``UNSUPPORTED`` lists those
not implemented (the legacy ``functions``, ``bad_words``, ...), each a 400 naming it unless it holds
its neutral value; completions add the chat-only tool fields (``CHAT_ONLY``). ``use_beam_search`` (vLLM's, with ``n``
as the beam width, ``length_penalty`` and HF's ``early_stopping``: ``server/beam_search.py``) refuses in the same way
the fields a beam search does not honour (``BEAM_SEARCH_UNSUPPORTED``: streaming, logprobs, stops, penalties,
filters, biases, constraints, tools). Other unknown fields are
ignored, as the OpenAI API does; ``HARMLESS`` names the ones clients are known to send that change nothing
here (bookkeeping, caching and routing hints).

The output's constraints (``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*``
fields) are checked here for their shape and for being one at most; what they mean is checked by the
engine's ``StructuredOutputsParams`` (``server/structured.py``).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from minfer.sampling_params import MAX_SEED

MAX_N = 128  # OpenAI's own limit on `n`
MAX_LOGPROBS = 20  # OpenAI's limit on `top_logprobs`

# Every request string is constrained (``Text``): pydantic-core then converts it to UTF-8 in Rust, which
# refuses a lone surrogate by itself; a plain ``str`` would pass it through untouched.
Text = Annotated[str, Field(min_length=0)]
StopStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]

# Accepted and without effect here: OpenAI's bookkeeping (user, metadata, store), caching and routing
# hints (prompt_cache_key, service_tier, safety_identifier), vLLM's request_id and priority.
HARMLESS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id",
            "priority")

# Not implemented: a 400 naming the field unless it holds one of its neutral values (None is always one).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],), "function_call": ("none",), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "logits_processors": ([],), "bad_words": ([],), "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,), "prompt_embeds": (), "audio": (), "modalities": (["text"],),
    "prediction": (), "web_search_options": (), "documents": (),
    "mm_processor_kwargs": (), "spaces_between_special_tokens": (True,),
}


# With use_beam_search: the fields a search does not honour, each a 400 unless at its neutral value. temperature and
# seed are accepted and change nothing (beam scores are raw logprobs, as in vLLM).
BEAM_SEARCH_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "logprobs": (False,), "top_logprobs": (), "echo": (False,), "prompt_logprobs": (),
    "suffix": ("",), "stop": ([],), "stop_token_ids": ([],), "min_tokens": (0,), "presence_penalty": (0.0, 0),
    "frequency_penalty": (0.0, 0), "repetition_penalty": (1.0, 1), "top_p": (1.0, 1), "top_k": (0, -1),
    "min_p": (0.0, 0), "logit_bias": ({},), "allowed_token_ids": (), "tools": ([],), "tool_choice": ("none",),
    "response_format": ({"type": "text"},), "structured_outputs": (), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (),
}

# Chat's tool fields and template variables, on /v1/completions (which has no messages and no template).
CHAT_ONLY: dict[str, tuple[Any, ...]] = {"tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (),
                                         "reasoning_effort": ()}
# The constraints on the output, one at most per request.
CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


def _unsupported_field(data: Any, unsupported: dict[str, tuple[Any, ...]], known: dict[str, Any]) -> str | None:
    """The first field not implemented and not at a neutral value; an unknown ``guided_*`` field is one."""
    if not isinstance(data, dict):
        return None
    for name, value in data.items():
        if value is None or not isinstance(name, str):
            continue
        neutral = unsupported.get(name)
        if (neutral is not None or (name.startswith("guided_") and name not in known)) and \
                not any(type(value) is type(v) and value == v for v in neutral or ()):
            return name
    return None


def check_unicode(value: Any) -> Any:
    """Raise on a string (at any depth, dict keys too) that is not valid unicode; ``value`` otherwise."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"is not valid unicode: a lone UTF-16 surrogate at character {exc.start}") from None
    elif isinstance(value, (list, tuple)):
        if value and type(value[0]) is int:  # a validated token-id list: millions of ints need no walk
            return value
        for item in value:
            check_unicode(item)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k)
            check_unicode(v)
    return value


# A JSON value of any shape (a schema, template variables): no Text constraint reaches inside it, so its
# strings are checked by walking it.
JsonObject = Annotated[dict[Text, Any], AfterValidator(check_unicode)]
JsonSchemaValue = Annotated[dict[Text, Any] | Text, AfterValidator(check_unicode)]


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage (so far) in every chunk")


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema``; ``strict`` is accepted and changes nothing: the schema is always enforced."""

    # OpenAI's rule: 1-64 of a-z, A-Z, 0-9, '_' and '-' (a plain str: Text's min_length=0 would win over 1)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class StructuredOutputsField(RequestModel):
    """vLLM's ``structured_outputs`` extra: one of its kinds (``StructuredOutputsParams`` checks that). A key
    it does not know is refused by name rather than ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: JsonSchemaValue | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED

    model: Text | None = Field(None, description="a name from GET /v1/models; omitted means the served model")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStr | list[StopStr] | None = Field(None, max_length=16)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=256)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[Text, float] | None = Field(None, description="OpenAI's: token id (a string) -> bias in "
                                                                   "[-100, 100], added to its logit")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, description="vLLM's: only these may be drawn")
    use_beam_search: bool = Field(False, description="vLLM's: n beams, the n best sequences are the choices")
    length_penalty: float = Field(1.0, allow_inf_nan=False, description="beam search: score = logprob / len ** this")
    early_stopping: bool | Literal["never"] = Field(False, description="beam search: HF's rule for when it ends")
    # constraints on the output (at most one)
    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text, json_object or json_schema")
    structured_outputs: StructuredOutputsField | None = Field(None, description="vLLM's: json, regex, choice, "
                                                                                "grammar or json_object")
    guided_json: JsonSchemaValue | None = Field(None, description="vLLM's older structured_outputs.json")
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None


    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        name = _unsupported_field(data, cls._unsupported, cls.model_fields)
        if name is not None:
            raise ValueError(f"{name} is not supported by this server (remove it or send null)")
        if isinstance(data, dict) and data.get("use_beam_search") is True:
            name = _unsupported_field(data, BEAM_SEARCH_UNSUPPORTED, cls.model_fields)
            if name is not None:
                raise ValueError(f"{name} is not supported with use_beam_search (remove it or send null)")
        return data

    @model_validator(mode="after")
    def _check_unsupported(self) -> "SamplingFields":
        for token, bias in (self.logit_bias or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers as strings), got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if not self.use_beam_search:
            for name, neutral in (("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != neutral:
                    raise ValueError(f"{name} applies only with use_beam_search")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        given = self.constraints()
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {', '.join(given[1:])} each constrain the output: send one of them")
        return self

    def constraints(self) -> list[str]:
        """The output constraints this request sets (``response_format`` of type text sets none)."""
        return [name for name in CONSTRAINTS if getattr(self, name) is not None
                and not (name == "response_format" and self.response_format.type == "text")]
