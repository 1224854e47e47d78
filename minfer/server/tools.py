"""Tool calling in chat completions: what ``tools`` and ``tool_choice`` mean for one request (vLLM's rules).

- ``"none"``: tools are not shown to the template and nothing is parsed.
- ``"auto"`` (the default with tools): the template sees the tools, the model writes freely, and the
  server's ``--tool-call-parser`` finds the calls in its text; it needs ``--enable-auto-tool-choice``.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one per
  call (at least one; at most one without ``parallel_tool_calls``), each a function of ``tools`` with its
  own parameters schema, so it always parses.
- a named function: the output is constrained to that function's parameters schema and is the arguments
  of one call to it.

Any mode but ``"none"`` needs a chat template that renders tools (one whose source mentions ``tools``):
without one the model would be asked to call functions it was never shown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minfer.sampling_params import StructuredOutputsParams
from minfer.server.errors import APIError
from minfer.server.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from minfer.server.structured import build
from minfer.server.tool_parsers import TOOL_PARSERS, NamedParser, RequiredParser, ToolParser

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # OpenAI: parameters omitted


@dataclass(slots=True)
class ToolPlan:
    """One request's tool handling: ``tools`` for the template (None: not passed), and how each choice's
    text is read (``new_parser``; in mode ``none`` it is plain content)."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None = None
    parser: str | None = None
    function: str | None = None  # the named function

    @property
    def needs_special_tokens(self) -> bool:
        """Whether each choice's parser reads special-token markers (auto with ``gpt_oss``)."""
        return self.mode == "auto" and self.parser is not None and TOOL_PARSERS[self.parser].needs_special_tokens

    def new_parser(self) -> ToolParser:
        """A fresh parser for one choice (any mode but ``none``)."""
        if self.mode == "named":
            assert self.function is not None
            return NamedParser(self.function)
        if self.mode == "required":
            return RequiredParser()
        assert self.mode == "auto" and self.parser is not None and self.tools is not None, self.mode
        return TOOL_PARSERS[self.parser](t["function"]["name"] for t in self.tools)  # calls to these only


def plan_tools(req: ChatCompletionRequest, template: Any, auto_parser: str | None) -> ToolPlan:
    """Check the request's tools against the chat template and the server's flags (``auto_parser``: the
    ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on, else None)."""
    choice = req.tool_choice
    if not req.tools or choice == "none":  # with tools, tool_choice defaults to "auto" (protocol)
        return ToolPlan("none")
    if "tools" not in str(template or ""):
        raise APIError(400, "tools: this model's chat template does not render tools; send a chat_template "
                            "that does (or --chat-template), or drop tools", "tools")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, "tool_choice: 'auto' needs the server started with --enable-auto-tool-choice "
                                "and --tool-call-parser (or send tool_choice 'required', 'none' or a function)",
                           "tool_choice")
        return ToolPlan("auto", tools, parser=auto_parser)
    if choice == "required":
        return ToolPlan("required", tools)
    assert isinstance(choice, NamedToolChoice)
    return ToolPlan("named", tools, function=choice.function.name)


def tool_constraint(req: ChatCompletionRequest, plan: ToolPlan) -> StructuredOutputsParams | None:
    """The output constraint of a required or named tool choice (run on the tokenizer pool: it builds the
    grammar). A parameters schema the engine refuses is a 400 naming that tool."""
    tools = req.tools or []
    if plan.mode == "named":
        i = next(i for i, t in enumerate(tools) if t.function.name == plan.function)
        return build({"json": _parameters(tools[i])}, f"tools[{i}].function.parameters")
    if plan.mode != "required":
        return None
    try:
        return StructuredOutputsParams(json=required_schema(tools, req.parallel_tool_calls is not False))
    except ValueError:  # find the tool at fault, to name it
        for i, tool in enumerate(tools):
            build({"json": _parameters(tool)}, f"tools[{i}].function.parameters")
        raise APIError(400, "tools: the tools' schemas cannot be enforced together", "tools") from None


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": <a tool's name>, "parameters": <its schema>}``.

    A tool's ``$defs`` (pydantic writes its nested models there, referenced as ``#/$defs/Name``) move to the
    combined schema's root, where those references now point; two tools defining one name differently
    cannot share the root and are a 400."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        params = dict(_parameters(tool))
        for name, sub in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, sub) != sub:
                raise APIError(400, f"tools[{i}].function.parameters: $defs.{name} differs from another tool's "
                                    f"definition of the same name", f"tools[{i}].function.parameters")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "const": tool.function.name},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def finish_reason(reason: str | None, parser: ToolParser) -> str | None:
    """``tool_calls`` for a choice that stopped normally with calls; a cut (``length``) stays one."""
    return "tool_calls" if reason == "stop" and parser.calls else reason
