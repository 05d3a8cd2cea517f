"""Server room: `fantai serve`'s process: the async engine, the app and uvicorn, with a graceful
SIGINT/SIGTERM (drain, then abort what is left after the grace period)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from fantai.engine import AsyncEngine
from fantai.engine_args import DEFAULT_MODEL_NAME, AsyncEngineArgs
from fantai.server.app import ServerConfig, build_app

logger = logging.getLogger("fantai.server")


@dataclass
class ListenOptions:
    """What uvicorn needs besides the app (the `fantai serve` flags of the same names)."""

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    access_log: bool = True
    shutdown_timeout: float = 10.0  # grace period for in-flight requests on SIGINT/SIGTERM


def make_server(app: Any, listen: ListenOptions, on_ready: Callable[[Any], None],
                on_exit: Callable[[], None], abort_all: Callable[[], int]) -> uvicorn.Server:
    grace = listen.shutdown_timeout

    class Server(uvicorn.Server):
        """uvicorn, but a handled SIGINT/SIGTERM ends in exit status 0 (no re-raise), and
        requests still running after the grace period are aborted in the engine, so their
        streams end cleanly (finish_reason 'abort') instead of being cut."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            async def abort_after_grace() -> None:
                await asyncio.sleep(grace)
                n = abort_all()
                if n:
                    logger.warning("grace period over: aborted %d in-flight request(s)", n)

            timer = asyncio.create_task(abort_after_grace())
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                on_ready(self)

    config = uvicorn.Config(app, host=listen.host, port=listen.port, log_level=listen.log_level,
                            access_log=listen.access_log, lifespan="off",
                            # uvicorn's own cancel is only the backstop after our abort
                            timeout_graceful_shutdown=grace + 5.0,
                            timeout_keep_alive=30)
    return Server(config)


def _banner(server: Any, engine: AsyncEngine, names: list[str], started_at: float) -> None:
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    kv = engine.kv_pool_info()
    print(f"fantai serve: model {engine.model_path} (served as {', '.join(names)}), "
          f"max model len {engine.max_model_len}", flush=True)
    print(f"fantai serve: KV pool {kv['num_blocks']} blocks x {kv['block_size']} tokens = "
          f"{kv['num_tokens']} tokens, {kv['bytes']} bytes ({kv['bytes'] / 2**20:.1f} MiB)",
          flush=True)
    print(f"fantai serve: listening on http://{host}:{port} (OpenAI base URL "
          f"http://{host}:{port}/v1)", flush=True)
    print(f"fantai serve: ready in {time.monotonic() - started_at:.2f} s", flush=True)


# `fantai serve`'s exit status after an engine fault (EX_SOFTWARE): non-zero, so a supervisor
# (systemd Restart=on-failure, Kubernetes, a shell loop) restarts the server.
EXIT_ENGINE_FAULT = 70
# After a fault: how long in-flight requests get to receive their error before the process
# exits, and how long /health keeps answering 503 (so probes see why) once they have.
FAULT_ANSWER_SECONDS = 5.0
FAULT_LINGER_SECONDS = 2.0


async def exit_on_engine_fault(engine: Any, ctx: Any, server: uvicorn.Server, poll: float = 0.05) -> None:
    """Waits for the engine to fail; then lets the in-flight requests get their error (the
    generators raise at once), keeps answering /health 503 for a moment, and asks uvicorn to exit.
    Meanwhile the guard refuses generation requests with 503."""
    while getattr(engine, "fault", None) is None:
        await asyncio.sleep(poll)
    logger.error("engine fault: %s; refusing new requests and exiting with status %d",
                 engine.fault, EXIT_ENGINE_FAULT)
    deadline = time.monotonic() + FAULT_ANSWER_SECONDS
    while ctx.active and time.monotonic() < deadline:
        await asyncio.sleep(poll)
    await asyncio.sleep(FAULT_LINGER_SECONDS)
    ctx.draining = True
    server.should_exit = True


async def serve(engine_args: AsyncEngineArgs, config: ServerConfig, listen: ListenOptions,
                started_at: float | None = None) -> int:
    """Loads the engine, serves until SIGINT/SIGTERM (status 0) or an engine fault (status
    EXIT_ENGINE_FAULT), then shuts the engine down and returns the exit status.
    started_at: time.monotonic() at process start, for the "ready in" line."""
    started_at = time.monotonic() if started_at is None else started_at
    engine = AsyncEngine(engine_args=engine_args)
    if not config.served_model_names:
        config.served_model_names = [engine_args.model or DEFAULT_MODEL_NAME]
    try:
        app = build_app(engine, config)

        def draining() -> None:
            app.state.ctx.draining = True

        server = make_server(app, listen, lambda s: _banner(s, engine, config.served_model_names, started_at),
                             draining, app.state.ctx.abort_all)
        watcher = asyncio.create_task(exit_on_engine_fault(engine, app.state.ctx, server))
        try:
            await server.serve()
        finally:
            watcher.cancel()
        return EXIT_ENGINE_FAULT if engine.fault is not None else 0
    finally:
        engine.shutdown()


def run(engine_args: AsyncEngineArgs, config: ServerConfig, listen: ListenOptions,
        started_at: float | None = None) -> int:
    logging.basicConfig(level=listen.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(engine_args, config, listen, started_at))
