"""The OpenAI requests: pydantic models of POST /v1/completions and /v1/chat/completions bodies.

Each request is ``SamplingFields`` (``request_fields.py``: the fields both share, strict mode, the
unicode rule, the fields refused by name, the output constraints) plus its own: a completion's
``prompt`` (text, token ids, or a batch of either, told apart by a discriminator), a chat's messages,
chat template fields and tools. The schema of ``tool_choice="required"`` or of a named function is one
more output constraint, so it may not come with another; the tool rules are in ``server/tools.py``.
Responses are in ``responses.py``; streamed chunks are built as plain dicts in ``stream.py`` (one per
token is hot).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from minfer.server.request_fields import (CHAT_ONLY, MAX_LOGPROBS, MAX_N, UNSUPPORTED, JsonObject, RequestModel,
                                          SamplingFields, Text)

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


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(min_length=1, max_length=64)]  # OpenAI's bound (its characters are not checked)


class FunctionCallIn(RequestModel):
    name: Text
    arguments: Text = Field(description="the call's arguments, JSON text")


class ToolCallIn(RequestModel):
    """A tool call of an earlier assistant message."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCallIn


# content parts of other modalities (OpenAI's and vLLM's names): refused by name, never dropped silently
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "audio", "video_url", "video", "file")


def text_only(content: Any) -> Any:
    """A content validator (chat messages, Responses items): an image, audio, video or file part is a 400 naming it.
    The server runs a text model (a multimodal checkpoint's language model, ``minfer/model/models/multimodal.py``),
    and a dropped part would change what the user asked without telling them."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise ValueError(f"a {kind!r} content part: this server runs a text model (of a multimodal "
                                 f"checkpoint, its language model); images, audio, video and files are not served")
    return content


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None

    _media = field_validator("content", mode="before")(text_only)
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


class FunctionDef(RequestModel):
    name: FunctionName
    description: Text | None = None
    parameters: JsonObject | None = Field(None, description="a JSON Schema; omitted means no arguments")
    strict: bool | None = Field(None, description="accepted; required and named tool choices always enforce")


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
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
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="OpenAI's field: the template variable of that name (gpt-oss's 'Reasoning: low'); "
                          "a chat_template_kwargs entry of that name wins")
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
