"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes.

Tokenizing a long prompt or rendering a long chat takes a while, so the work runs on the server's
tokenizer pool (``ServerContext.offload``), as the completions' does: the event loop stays free for
other clients, and no Rust tokenizer is used from two threads at once ('Already borrowed'). The
pool's copies are made after ``--chat-template`` was set, so /tokenize renders the chats /v1/chat does.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from minfer.server.errors import APIError
from minfer.server.offload import OffloadedBodyRoute
from minfer.server.protocol import ChatMessage
from minfer.server.responses import ErrorResponse
from minfer.server.serving import ServerContext

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 404)}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(_Request):
    """Text (``prompt``) or a conversation (``messages``, rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = Field(
        None, description="default true for `prompt`, false for `messages` (the template places BOS itself)")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one of them")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _check_unicode(text: str, field: str) -> None:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``); no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{field}: not valid Unicode (a lone surrogate at character {exc.start})", field) from None


def _encode(tok: Any, text: str, add_special_tokens: bool, field: str) -> list[int]:
    _check_unicode(text, field)
    try:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    except Exception as exc:  # noqa: BLE001 - text the tokenizer refuses is the caller's to fix
        raise APIError(400, f"{field}: the tokenizer cannot encode it ({type(exc).__name__})", field) from None


def _render(tok: Any, req: TokenizeRequest) -> str:
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "messages: this model's tokenizer has no chat template; tokenize a prompt", "messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages or ()]
    for i, m in enumerate(messages):
        for key in ("content", "name"):
            if key in m:
                _check_unicode(m[key], f"messages[{i}].{key}")
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message)
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. roles out of order) are the caller's
        raise APIError(400, f"messages: the chat template rejected them: {exc}", "messages") from None


def _tokenize(tok: Any, req: TokenizeRequest, max_model_len: int) -> TokenizeResponse:
    if req.prompt is not None:
        ids = _encode(tok, req.prompt, req.add_special_tokens is not False, "prompt")
    else:
        ids = _encode(tok, _render(tok, req), bool(req.add_special_tokens), "messages")
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def _detokenize(tok: Any, ids: list[int], vocab_size: int) -> DetokenizeResponse:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise APIError(400, f"tokens: every id must be in [0, {vocab_size}), got {bad}", "tokens")
    try:
        return DetokenizeResponse(prompt=tok.decode(ids))
    except Exception as exc:  # noqa: BLE001 - an id the tokenizer does not know
        raise APIError(400, f"tokens: the tokenizer cannot decode them ({type(exc).__name__})", "tokens") from None


def tokenize_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(route_class=OffloadedBodyRoute)  # bodies parsed off the event loop

    @router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest, raw: Request) -> TokenizeResponse:
        ctx.check_model(req.model)
        ctx.require_tokenizer("tokenize", "prompt" if req.prompt is not None else "messages")
        return await ctx.offload(lambda p: _tokenize(p.tokenizer, req, ctx.max_model_len))

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        ctx.check_model(req.model)
        ctx.require_tokenizer("detokenize", "tokens")
        return await ctx.offload(lambda p: _detokenize(p.tokenizer, req.tokens, p.vocab_size))

    return router
