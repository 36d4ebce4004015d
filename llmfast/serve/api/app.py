"""The FastAPI app: OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models),
vLLM's /tokenize, /detokenize and /version, /health and /metrics, over one `EngineFront`
(the engine on a thread of this process, or in another process)."""

from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from llmfast.serve.api.errors import APIError, from_validation_error, install_handlers
from llmfast.serve.api.generation import run_generation
from llmfast.serve.api.metrics import CONTENT_TYPE, ServerMetrics
from llmfast.serve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from llmfast.serve.api.responses import Kind
from llmfast.serve.api.sampling import chat_inputs, completion_inputs
from llmfast.serve.api.tokenization import ask, detokenize_query, tokenize_query
from llmfast.serve.frontend_types import EngineFront
from llmfast.version import __version__

# An oversized body is read to its end (discarded) so the client gets its 413 instead of a
# reset connection, but only this far past the limit.
_DRAIN_LIMIT = 64 << 20


@dataclass(frozen=True)
class ServeConfig:
    model_name: str  # what /v1/models lists
    model_aliases: tuple[str, ...] = ()  # other names a request may use (the --model spec)
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    # How chat's tool_choice "auto" reads calls (tool_parsers.PARSERS); None: from the
    # model's chat template and family.
    tool_call_parser: str | None = None


def build_app(front: EngineFront, config: ServeConfig) -> FastAPI:
    limits = front.limits
    metrics = ServerMetrics(front)
    names = {config.model_name, *config.model_aliases}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        front.start()
        try:
            yield
        finally:
            front.stop()
            await asyncio.to_thread(front.join, 10.0)

    app = FastAPI(title="llmfast", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    install_handlers(app)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 config.api_key.encode()):
            raise APIError("invalid or missing API key (Authorization: Bearer KEY)", 401,
                           code="invalid_api_key")

    def check_model(model: str | None) -> None:
        # 400 as the issue asks (OpenAI itself answers 404); the code still says which.
        if model is not None and model not in names:
            raise APIError(f"the model {model!r} does not exist; this server serves "
                           f"{config.model_name!r}", 400, "model", "model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if front.failure is not None:
            return JSONResponse({"status": "error", "message": front.failure},
                                status_code=503)
        if not front.running:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    card = {"id": config.model_name, "object": "model", "created": created,
            "owned_by": "llmfast", "max_model_len": limits.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model:path}")  # the client's models.retrieve; ids may hold "/"
    async def model_card(request: Request, model: str) -> Response:
        authorize(request)
        if model not in names:
            raise APIError(f"the model {model!r} does not exist; this server serves "
                           f"{config.model_name!r}", 404, "model", "model_not_found")
        return JSONResponse(card)

    async def generate(request: Request, kind: Kind) -> Response:
        authorize(request)
        if kind == "completion":
            req = await _parse(request, CompletionRequest, config.max_body_bytes)
            check_model(req.model)
            inputs = completion_inputs(req, limits)
            extra = {"echo": req.echo, "want_logprobs": req.logprobs is not None}
        else:
            req = await _parse(request, ChatCompletionRequest, config.max_body_bytes)
            check_model(req.model)
            inputs = chat_inputs(req, limits)
            extra = {"want_logprobs": req.logprobs}
        extra["want_prompt_logprobs"] = req.prompt_logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await run_generation(request, front, metrics, kind, config.model_name, inputs,
                                    stream=req.stream, include_usage=include_usage, **extra)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        authorize(request)
        req = await _parse(request, TokenizeRequest, config.max_body_bytes)
        check_model(req.model)
        query = tokenize_query(req)
        ids = await ask(front, query, "prompt" if req.prompt is not None else "messages")
        return JSONResponse({"count": len(ids), "max_model_len": limits.max_model_len,
                             "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        authorize(request)
        req = await _parse(request, DetokenizeRequest, config.max_body_bytes)
        check_model(req.model)
        text = await ask(front, detokenize_query(req), "tokens")
        return JSONResponse({"prompt": text})

    @app.get("/version")
    async def version(request: Request) -> Response:
        authorize(request)  # vLLM leaves it open; here every route but the probes asks
        return JSONResponse({"version": __version__})

    return app


async def _parse(request: Request, model: type[BaseModel], limit: int):
    body = await _read_body(request, limit)  # read first: the client gets its answer
    _check_content_type(request.headers.get("content-type"))
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_content_type(header: str | None) -> None:
    """JSON, or no Content-Type at all. Refusing text/plain and form types matters beyond
    tidiness: a web page may send those cross-origin without asking (no CORS preflight),
    so accepting them would let any site a user visits run requests on a local server."""
    if header is None:
        return
    media = header.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise APIError(f"the request body must be JSON (Content-Type: application/json), "
                       f"got Content-Type {media or header!r}", 415,
                       code="unsupported_media_type")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                too_big = True
            if too_big:
                if size > limit + _DRAIN_LIMIT:
                    break
                continue
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: nobody reads the answer
        raise APIError("the client disconnected while sending the request", 400) from None
    if too_big:
        raise APIError(f"the request body is larger than the server's limit of {limit} bytes",
                       413, code="request_too_large")
    return b"".join(chunks)
