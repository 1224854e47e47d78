"""POST /v1/responses bodies (OpenAI's Responses API): pydantic models of the request and its input items, and
the input as chat messages.

A response runs through the chat machinery (``responses_api.py``), so the request is ``SamplingFields`` (strict
mode, the unicode rule, vLLM's sampling extras such as ``seed``, ``top_k`` or ``structured_outputs``) plus the
Responses API's own fields. What the chat machinery cannot honour is refused by name rather than dropped:
built-in tools (``web_search``, ``file_search``, ...), tool choices other than none/auto/required/a function,
``background``, ``include`` values, ``truncation="auto"``, prompt templates, conversations, image / audio / file
inputs, and item types other than messages, function calls, their outputs and reasoning.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from minfer.server.protocol import FunctionDef, FunctionName, text_only
from minfer.server.request_fields import UNSUPPORTED, JsonObject, RequestModel, SamplingFields, Text

# Fields of the API this server does not implement: a 400 naming the field unless it holds a neutral value.
RESPONSES_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "conversation": (), "prompt": (), "truncation": ("disabled",), "top_logprobs": (0,),
    "max_tool_calls": (), "context_management": (), "n": (1,),
    "use_beam_search": (False,), "length_penalty": (1.0, 1), "early_stopping": (False,),  # one answer, sampled
    "response_format": (),  # chat's name: the Responses API's is text.format
}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
EFFORTS = ("low", "medium", "high")  # the chat template's reasoning_effort variable (gpt-oss's "Reasoning: low")


class TextPart(RequestModel):
    """A text content part: ``input_text`` (a user's, system's or tool's), ``output_text`` (an earlier answer)."""

    type: Literal["input_text", "output_text", "text"]
    text: Text


class RefusalPart(RequestModel):
    type: Literal["refusal"]
    refusal: Text


Part = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


def _joined(content: str | list[TextPart | RefusalPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


class MessageItem(RequestModel):
    """A message (``type`` may be left out: OpenAI's "easy" input message); ``id`` and ``status`` of an earlier
    output item are accepted and ignored."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[Part]

    _media = field_validator("content", mode="before")(text_only)


class FunctionCallItem(RequestModel):
    """A call an earlier response made (its ``function_call`` output item, sent back)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: FunctionName
    arguments: Text = Field(description="the call's arguments, JSON text")


class FunctionCallOutputItem(RequestModel):
    """What the caller's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: Text | list[Part]

    _media = field_validator("output", mode="before")(text_only)


class ReasoningItem(RequestModel):
    """An earlier response's reasoning, sent back: accepted and left out of the prompt (chat templates drop
    earlier turns' reasoning, and minfer's chat messages carry none)."""

    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")],
                      Discriminator(_item_kind, custom_error_type="input_item_type",
                                    custom_error_message=f"an input item is one of {', '.join(ITEM_TYPES)}")]


def _input_kind(value: Any) -> str | None:
    return "str" if isinstance(value, str) else "list[item]" if isinstance(value, list) else None


Input = Annotated[Annotated[Text, Tag("str")] | Annotated[list[InputItem], Tag("list[item]")],
                  Discriminator(_input_kind, custom_error_type="input_type",
                                custom_error_message="input is a string or a list of items")]


class FunctionTool(FunctionDef):
    """The Responses API's flat function tool: chat's function fields (which chat nests under ``function``) beside
    its type."""

    type: Literal["function"]


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: Text


class TextFormat(RequestModel):
    """``text.format``: ``text`` (free), ``json_object``, or ``json_schema`` with its name and schema at this
    level (chat nests them under ``json_schema``); ``strict`` is accepted, the schema is always enforced."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check_format(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="only 'medium' (the default)")

    @field_validator("verbosity")
    @classmethod
    def _medium_only(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise ValueError(f"{value!r} is not supported (the model writes as it does; send 'medium' or null)")
        return value


class ReasoningConfig(RequestModel):
    """``effort`` low/medium/high is the chat template's ``reasoning_effort`` (as chat's field of that name);
    summaries are not written: a reasoning item carries the reasoning text itself."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @model_validator(mode="after")
    def _check_reasoning(self) -> ReasoningConfig:
        if self.effort is not None and self.effort not in EFFORTS:
            raise ValueError(f"effort {self.effort!r} is not supported (one of {', '.join(EFFORTS)}, or null)")
        if self.summary is not None or self.generate_summary is not None:
            raise ValueError("summaries are not supported (a reasoning item holds the reasoning text itself); "
                             "send summary null")
        return self


class ResponsesRequest(SamplingFields):
    """POST /v1/responses. ``input`` is a user message's text or a list of items; ``instructions`` is a system
    message before them (not carried over by ``previous_response_id``, as in OpenAI's API). ``store`` keeps the
    response for ``previous_response_id`` and ``GET /v1/responses/{id}`` (``responses_store.py``)."""

    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {**UNSUPPORTED, **RESPONSES_UNSUPPORTED}

    input: Input
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="null means up to the context")
    tools: list[FunctionTool] | None = Field(None, max_length=512)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (true if unset)")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: Text | None = None
    include: list[Text] | None = Field(None, description="no include values are supported: send [] or null")
    metadata: JsonObject | None = None
    truncation: Literal["disabled", "auto"] | None = Field(None, description="only 'disabled'")

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        """Name the first item of a type not taken (the union's own error could not say which type)."""
        if isinstance(value, list):
            for i, item in enumerate(value):
                kind = _item_kind(item)
                if isinstance(kind, str) and kind not in ITEM_TYPES:
                    raise ValueError(f"item {i} is of type {kind!r}, which this server does not take (it takes "
                                     f"{', '.join(ITEM_TYPES)} items)")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise ValueError(f"tool {i} is of type {kind!r}: this server runs function tools only (built-in "
                                     f"tools such as web_search, file_search or mcp are not supported)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"a tool choice of type {kind!r} is not supported (send 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'name': ...}})")
        return value

    @field_validator("include")
    @classmethod
    def _no_includes(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"{value[0]!r} is not supported (this server adds nothing on request: send [] or null)")
        return value

    @model_validator(mode="after")
    def _check_responses(self) -> ResponsesRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools holds a function name more than once")
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.name!r}, which is not in tools")
        return self

    def format(self) -> TextFormat | None:
        """``text.format`` unless it is plain text."""
        fmt = self.text.format if self.text is not None else None
        return fmt if fmt is not None and fmt.type != "text" else None


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """The request's input as chat messages: a function call joins the assistant message just before it (or
    starts one), its output is a ``tool`` message; reasoning items are left out."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for item in value:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _joined(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
    return messages
