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

from llmfast.serve.protocol import UNION_HINTS

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_error",
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
    """The first pydantic complaint as one line, naming the top-level field (OpenAI's
    `param`); pydantic's deeper location parts name union members, not user fields."""
    first = error.errors()[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = str(loc[0]) if loc else None
    msg = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "")
    if param in UNION_HINTS and len(loc) > 1 and isinstance(loc[1], str):
        msg = f"must be {UNION_HINTS[param]}"  # pydantic would name one union member
    if first.get("type") == "json_invalid":
        return APIError(f"malformed JSON: {msg.removeprefix('Invalid JSON: ')}", 400,
                        code="invalid_json")
    return APIError(f"{param}: {msg}" if param else (msg or "invalid request"), 400, param,
                    "invalid_value")


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
                      "POST /v1/chat/completions"
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        message = f"internal error: {type(exc).__name__}"
        return JSONResponse(error_body(message, 500), status_code=500)
