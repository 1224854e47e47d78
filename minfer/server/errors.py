"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

OpenAI clients read ``error.message`` and the status code; ``param`` names the offending field
so a caller can fix the request without reading server logs. Validation problems are 400 (not
FastAPI's default 422), as OpenAI returns them.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("minfer.server")

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable_error"}
_LEADING_NAME = re.compile(r"^(?:Value error, )?([a-z_]+) ")


class APIError(Exception):
    """An error to return to the client as-is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(exc: Exception, fields: set[str] | None = None) -> APIError:
    """A 400 from a ValueError whose message starts with the field's name (SamplingParams' style)."""
    message = str(exc)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and (fields is None or match.group(1) in fields) else None
    return APIError(400, message, param)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'; union tags are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part)) and part not in ("str", "int", "float", "bool"):
            out += ("." if out else "") + str(part)
        else:
            break  # a union member's tag such as 'list[int]': the field path has ended
    return out or None


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    # Only the body itself of the wrong shape is "not an object"; a nested field's shape error names the field.
    if tuple(first.get("loc", ())) == ("body",) and \
            first.get("type") in ("model_attributes_type", "dict_type", "missing", "model_type"):
        return error_response(400, "the request body must be a JSON object")
    param = _param_of(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        match = _LEADING_NAME.match(msg)
        param = match.group(1) if match else None
        return error_response(400, msg, param)
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 and not _same_field(errors) else ""
    return error_response(400, f"{param}: {msg}{more}", param)


def _same_field(errors: list[dict[str, Any]]) -> bool:
    return len({_param_of(tuple(e.get("loc", ()))) for e in errors}) == 1


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(exc)


def internal_error_response(exc: BaseException) -> JSONResponse:
    """A 500 for a failure nobody anticipated: the details go to the log, never to the client (they may
    hold internals or the request's own bytes)."""
    logger.error("unhandled error while serving a request", exc_info=exc)
    return error_response(500, "internal server error (details are in the server log)", code="internal_error")
