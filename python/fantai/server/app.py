"""Server room: the FastAPI application (middleware, error handlers, small routes, sub-routers)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import fantai
from fantai.server import anthropic_api, dashboard, errors, openai_api, responses_api
from fantai.server.chat import ToolPlan, render_prompt, template_messages
from fantai.server.errors import APIError, error_response
from fantai.server.protocol import DetokenizeRequest, TokenizeRequest
from fantai.server.serving import ClientGone
from fantai.server.state import ServerConfig, ServerContext

__all__ = ["ServerConfig", "ServerContext", "build_app"]

# Reachable without an API key (probes, scrapers, and the dashboard: see dashboard.py).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"}) | dashboard.DASHBOARD_PATHS


# The routes that run the model; the overload bound counts and refuses only these.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"})


class GuardMiddleware:
    """API key check (constant time), request body limit (413) and the overload bound (503),
    before any route runs: a refused request costs no parsing, so a burst cannot crowd out
    /health or the requests being served."""

    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        key = ctx.config.api_key
        self.key = key.encode() if key else None
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            await error_response(path, 401, "Invalid or missing API key. Send it as "
                                 "'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                                 code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        generation = path in GENERATION_PATHS
        if generation and self.ctx.fault is not None:
            # The engine failed and the process is about to exit: never accept what cannot be
            # served (a supervisor restarts the server; clients retry elsewhere or later).
            await error_response(path, 503, "The engine has failed and this server is restarting; "
                                 "retry shortly.", code="engine_failed",
                                 headers={"Retry-After": "1", "Connection": "close"})(scope, receive, send)
            return
        if generation and self.in_flight >= self._capacity():
            self.ctx.metrics.finished["overload"] = self.ctx.metrics.finished.get("overload", 0) + 1
            # The body is left unread, so the connection cannot carry another request: close it.
            await error_response(path, 503, f"The server is overloaded ({self.in_flight} requests in "
                                 "flight); retry shortly.", code="overloaded",
                                 headers={"Retry-After": "1", "Connection": "close"})(scope, receive, send)
            return
        # The slot is taken before the body is read: a burst's requests all pass the check
        # before any body has arrived, so counting later would let all of them in.
        if generation:
            self.in_flight += 1
        try:
            body = await self._read_body(scope, receive)
            if body is None:
                limit = self.ctx.config.max_body_bytes
                await error_response(path, 413, f"Request body is larger than the server's limit of "
                                     f"{limit} bytes.", code="request_too_large")(scope, receive, send)
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            if generation:
                self.in_flight -= 1

    def _capacity(self) -> int:
        """The running batch plus the bounded waiting queue (--max-waiting-requests)."""
        options = getattr(self.ctx.engine, "options", None)
        return int(getattr(options, "max_num_seqs", 256)) + self.ctx.config.max_waiting_requests

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        assert self.key is not None
        return hmac.compare_digest(given, self.key)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (checked on Content-Length first)."""
        limit = self.ctx.config.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect

    return replay


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


def _install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, errors.validation_handler)
    app.add_exception_handler(APIError, errors.api_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, errors.internal_error_handler)


def _add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        if ctx.fault is not None:
            return JSONResponse({"status": "failed", "error": ctx.fault}, status_code=503)
        if ctx.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": fantai.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": ctx.config.created,
                 "owned_by": "fantai", "root": ctx.engine.model_path,
                 "max_model_len": ctx.max_model_len} for name in ctx.config.served_model_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(ctx.metrics.render(ctx.engine.stats()),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, str]:
        # Admin: drop every cached prefix block not in use (e.g. after changing a system prompt).
        ctx.engine.reset_prefix_cache()
        return {"status": "ok"}

    @app.post("/release_memory")
    async def release_memory() -> dict[str, str]:
        # Admin: give unused KV pages back to the OS now instead of after the idle period.
        ctx.engine.release_memory()
        return {"status": "ok"}


def _add_token_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("Give exactly one of 'prompt' or 'messages'.", param="prompt")
        if body.messages is not None:
            text = render_prompt(ctx, template_messages(body.messages), ToolPlan(None, False),
                                 body.add_generation_prompt)
            ids = ctx.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ctx.model_name(body.model)
        bad = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise APIError(f"Token id {bad[0]} is outside the vocabulary [0, {ctx.vocab_size}).",
                           param="tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}


def build_app(engine: Any, config: ServerConfig) -> FastAPI:
    """The ASGI app serving `engine` (a fantai.engine.AsyncEngine) under `config`."""
    ctx = ServerContext.create(engine, config)
    app = FastAPI(title="fantai", version=fantai.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    _install_handlers(app)
    _add_info_routes(app, ctx)
    _add_token_routes(app, ctx)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    dashboard.install(app, ctx)
    app.add_middleware(GuardMiddleware, ctx=ctx)
    return app
