"""The OpenAI wire format: pydantic models of requests and (non-streamed) responses.

Requests are validated in strict mode, so ``"max_tokens": "5"`` or ``"stream": 1`` is a 400
naming the field rather than a silent coercion, and every range check happens here, in the
HTTP handler, before anything reaches the engine thread. Every string, at any depth, must be
valid unicode: a lone UTF-16 surrogate (``"\\ud800"`` in JSON) would make the tokenizer, the chat
template or the response's own encoding raise later. Names beyond OpenAI's (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ...) are vLLM's, which the ``openai`` client sends through
``extra_body``. Streamed chunks are built as plain dicts in ``stream.py``: one per token is hot.

A field that would change the output is either honoured or refused: ``UNSUPPORTED`` lists those
not implemented (the legacy ``functions``, beam search, ...), each a 400 naming it unless it holds
its neutral value; completions add the chat-only tool fields. Other unknown fields are ignored, as
the OpenAI API does; ``HARMLESS`` names the ones clients are known to send that change nothing here
(bookkeeping, caching and routing hints).

The output's constraints (``response_format``, vLLM's ``structured_outputs`` and its older
``guided_*`` fields, the schema of ``tool_choice="required"`` or of a named function) are checked
here for their shape and for being one at most; what they mean is checked by the engine's
``StructuredOutputsParams`` (``server/structured.py``), and the tool rules in ``server/tools.py``.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

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
    "guided_whitespace_pattern": (), "use_beam_search": (False,), "length_penalty": (1.0, 1),
    "logits_processors": ([],), "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
    "return_tokens_as_token_ids": (False,), "prompt_embeds": (), "audio": (), "modalities": (["text"],),
    "prediction": (), "reasoning_effort": (), "web_search_options": (), "documents": (),
    "mm_processor_kwargs": (), "spaces_between_special_tokens": (True,),
}


# Chat's tool fields, on /v1/completions (which has no messages to call tools from).
CHAT_ONLY: dict[str, tuple[Any, ...]] = {"tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": ()}
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


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage (so far) in every chunk")


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``; ``strict`` is accepted and changes nothing: the schema is always enforced."""

    # OpenAI's rule: 1-64 of a-z, A-Z, 0-9, '_' and '-' (a plain str: Text's min_length=0 would win over 1)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_format(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs`` extra: one of its kinds (``StructuredOutputsParams`` checks that). A key
    it does not know is refused by name rather than ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: JsonSchemaValue | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(_Request):
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
    logit_bias: dict[Text, float] | None = Field(None, description="not supported: must be empty")
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
        return data

    @model_validator(mode="after")
    def _check_unsupported(self) -> "SamplingFields":
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
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


PromptIds = Annotated[list[int], Field(min_length=1)]


def _prompt_kind(value: Any) -> str | None:
    """The one union member a prompt can be, from its type and its first item. A plain union would try each
    member in turn, and a million-id list tried as ``list[str]`` first costs a million errors (seconds)."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and value:
        first = value[0]
        return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"
    return "list[int]" if isinstance(value, list) else None


Prompt = Annotated[Union[Annotated[Text, Tag("str")], Annotated[Annotated[list[Text], Field(min_length=1)], Tag("list[str]")],
                         Annotated[PromptIds, Tag("list[int]")],
                         Annotated[Annotated[list[PromptIds], Field(min_length=1)], Tag("list[list[int]]")]],
                   Discriminator(_prompt_kind, custom_error_type="prompt_type",
                                 custom_error_message="a prompt is a string, a list of strings, a list of token ids "
                                                      "or a list of token-id lists")]


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt`` is text, token ids, or a batch of either."""

    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {**UNSUPPORTED, **CHAT_ONLY}

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, description="OpenAI's default is 16; null means up to the context; "
                                                         "0 only with echo (score the prompt, generate nothing)")
    max_completion_tokens: int | None = Field(None, ge=1, description="the same as max_tokens")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="return the prompt before the completion (and its logprobs with logprobs)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: top-k per prompt token")
    add_special_tokens: bool = Field(True, description="vLLM's: BOS etc. when tokenizing a text prompt")
    suffix: Text | None = Field(None, description="not supported: must be null")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only best_of == n is supported")

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if "max_tokens" in self.model_fields_set and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens and max_tokens disagree: send one of them")
        if self.stream and (self.echo or self.prompt_logprobs is not None):
            raise ValueError(f"{'echo' if self.echo else 'prompt_logprobs'} is not supported when streaming")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (minfer returns every sample)")
        return self

    @property
    def output_tokens(self) -> int | None:
        """max_tokens, or max_completion_tokens where only that one was sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TextPart(_Request):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(min_length=1, max_length=64)]  # OpenAI's bound (its characters are not checked)


class FunctionCallIn(_Request):
    name: Text
    arguments: Text = Field(description="the call's arguments, JSON text")


class ToolCallIn(_Request):
    """A tool call of an earlier assistant message."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant message's calls")
    tool_call_id: Text | None = Field(None, description="a tool message's answer is to this call")

    @model_validator(mode="after")
    def _check_tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages only")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to tool messages only")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(_Request):
    name: FunctionName
    description: Text | None = None
    parameters: JsonObject | None = Field(None, description="a JSON Schema; omitted means no arguments")
    strict: bool | None = Field(None, description="accepted; required and named tool choices always enforce")


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template over ``messages``.

    ``tool_choice`` left out is ``"auto"`` when tools are given (OpenAI's and vLLM's default), which, as
    in vLLM, needs the server's ``--enable-auto-tool-choice``; ``"required"`` with an empty ``tools`` is
    ``"none"`` (vLLM's reading of OpenAI)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM's: top-k per prompt token")
    # the chat template (vLLM's names)
    chat_template: str | None = Field(None, min_length=1, description="a Jinja template replacing the model's")
    add_generation_prompt: bool = Field(True, description="end with the assistant's header, so the model answers")
    continue_final_message: bool = Field(False, description="leave the last (assistant) message open to extend it")
    chat_template_kwargs: JsonObject | None = Field(None, description="extra variables for the template")
    add_special_tokens: bool = Field(False, description="add BOS etc. on top of what the template writes")
    # tools
    tools: list[ChatTool] | None = Field(None, max_length=512)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (true if unset)")

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported when streaming")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        repeat = _first_repeat(names)
        if repeat is not None:
            raise ValueError(f"tools holds the function name {repeat!r} more than once")
        if self.tool_choice is None and self.tools:
            self.tool_choice = "auto"
        if self.tool_choice == "required" and self.tools == []:
            self.tool_choice = "none"
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.parallel_tool_calls is not None and not self.tools:
            raise ValueError("parallel_tool_calls is only allowed with tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             f"in tools ({', '.join(names)})")
        given, choice = self.constraints(), self.tool_choice
        if given and choice not in (None, "none", "auto"):  # "required" or a named function
            name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
            raise ValueError(f"tool_choice {name!r} constrains the output, and so does {given[0]}: send one of them")


def _first_repeat(names: list[str]) -> str | None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


# ---- responses --------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """With echo, the prompt's tokens come first; the first has no logprob (None), as in vLLM."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minfer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
