"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause ends here as a 4xx with such a body; an internal
failure becomes a 500 with the same shape and a one-line message (the traceback goes to
the server's log, never to the client).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmfast.serve.api.protocol import UNION_HINTS

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 500: "internal_error",
          503: "service_unavailable"}


class APIError(Exception):
    """A request the server refuses; becomes an OpenAI error body with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.code)


def error_body(message: str, status: int, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def from_validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic complaint as one line: `messages[0].role: Input should be ...`.
    `param` is the top-level field (OpenAI's convention)."""
    first = error.errors()[0]
    kind = first.get("type")
    msg = first.get("msg", "invalid value")
    if kind == "json_invalid":
        return APIError(f"malformed JSON: {msg.removeprefix('Invalid JSON: ')}", 400,
                        code="invalid_json")
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return APIError("the request body must be a JSON object" if kind == "model_type"
                        else msg, 400, code="invalid_value")
    path, field = "", str(loc[0])
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_type_tag(part):  # pydantic names the union member it tried last
            if field in UNION_HINTS:
                msg = f"must be {UNION_HINTS[field]}"
            break
        else:
            path, field = f"{path}.{part}" if path else part, part
    if kind == "extra_forbidden":
        msg = "unknown field"
    return APIError(f"{path}: {msg}", 400, str(loc[0]), "invalid_value")


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = from_validation_error(exc)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such endpoint; see GET /v1/models, POST /v1/completions, " \
                      "POST /v1/chat/completions, POST /tokenize, POST /detokenize"
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        message = f"internal error: {type(exc).__name__}"
        return JSONResponse(error_body(message, 500), status_code=500)
