"""The OpenAI wire format: pydantic models of requests and (non-streamed) responses.

Requests are validated in strict mode, so ``"max_tokens": "5"`` or ``"stream": 1`` is a 400
naming the field rather than a silent coercion, and every range check happens here, in the
HTTP handler, before anything reaches the engine thread. Unknown fields are ignored, as the
OpenAI API and vLLM do. Names beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ...) are vLLM's, which the ``openai`` client sends through ``extra_body``.
Streamed chunks are built as plain dicts in ``stream.py``: one per token is hot.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minfer.sampling_params import MAX_SEED

MAX_N = 128  # OpenAI's own limit on `n`
MAX_LOGPROBS = 20  # OpenAI's limit on `top_logprobs`

StopStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = Field(None, description="a name from GET /v1/models; omitted means the served model")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 is greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStr | list[StopStr] | None = Field(None, max_length=16)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=256)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")

    @model_validator(mode="after")
    def _check_unsupported(self) -> "SamplingFields":
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


PromptIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt`` is text, token ids, or a batch of either."""

    prompt: str | Annotated[list[str], Field(min_length=1)] | PromptIds | Annotated[
        list[PromptIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1, description="OpenAI's default is 16; null means up to the context")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="not supported: must be false")
    suffix: str | None = Field(None, description="not supported: must be null")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only best_of == n is supported")

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (minfer returns every sample)")
        return self


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions; the prompt is the tokenizer's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


# ---- responses --------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
