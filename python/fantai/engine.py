"""The async front of the core for the server: the C++ EngineLoop steps in its own thread (GIL
released); one dispatcher thread waits for its outputs and hands them to asyncio."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fantai import _C
from fantai.config import CoreHolder
from fantai.engine_args import AsyncEngineArgs, EngineArgs, engine_args_from
from fantai.exceptions import EngineDeadError, RequestTimeoutError
from fantai.outputs import RequestOutput
from fantai.requests import RequestState
from fantai.sampling_params import SamplingParams
from fantai.structured import structured_spec

logger = logging.getLogger("fantai")


class AsyncEngine(CoreHolder):
    def __init__(self, model: str | None = None, *, engine_args: EngineArgs | None = None,
                 **kwargs: Any) -> None:
        """kwargs: any AsyncEngineArgs field (EngineArgs' and idle_release_seconds); with
        engine_args too, they override its values."""
        options = engine_args_from(AsyncEngineArgs, model, engine_args, kwargs, "AsyncEngine")
        super().__init__(options)
        # From here on the loop thread owns self.engine: only the thread-safe EngineLoop is used.
        self._loop = _C.EngineLoop(self.engine)
        # After a burst, unused KV pages go back to the OS once the engine has idled this long.
        self._loop.set_idle_release(options.idle_release_seconds)
        self._owner: dict[int, tuple[RequestState, int, asyncio.Queue[None], asyncio.AbstractEventLoop]] = {}
        self._by_request: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._running = True
        self.request_timeout = options.request_timeout  # seconds from arrival; 0: none
        self.fault: str | None = None  # why the engine failed, once it has
        self._loop.start()
        self._dispatcher = threading.Thread(target=self._dispatch_forever, name="fantai-dispatch", daemon=True)
        self._dispatcher.start()

    # ---- public API ------------------------------------------------------------------------
    def kv_pool_info(self) -> dict[str, int]:
        return {"num_blocks": self.engine.num_blocks, "block_size": self.engine.block_size,
                "num_tokens": self.engine.num_blocks * self.engine.block_size,
                "bytes": self.engine.kv_cache_bytes}

    def stats(self) -> dict[str, Any]:
        stats = self._loop.stats()
        stats["kv_resident_bytes"] = self._loop.kv_resident_bytes()
        return stats

    def snapshot(self) -> dict[str, Any] | None:
        """The block-level snapshot the loop thread published last (block states, shared blocks'
        ref counts, live requests with block tables, stats), or None before the first. Calling it
        keeps the loop publishing (bounded rate) for a few seconds; nobody calling costs nothing."""
        return self._loop.snapshot()

    def steps_since(self, after: int) -> list[dict[str, Any]]:
        """Per-step batch records (decode/prefill tokens, queue sizes) with step > after, recorded
        while someone calls snapshot()."""
        return self._loop.steps_since(after)

    def reset_prefix_cache(self) -> None:
        self._loop.reset_prefix_cache()

    def release_memory(self) -> None:
        self._loop.release_memory()

    async def prepare_structured(self, params: SamplingParams) -> None:
        """Compiles the request's grammar beside the event loop; ValueError when it won't."""
        spec = structured_spec(params)
        if spec is not None and not self.grammars.ready(spec):
            await asyncio.get_running_loop().run_in_executor(None, self.grammars.prepare, spec)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields the request's RequestOutput each time it changes (a live object: cumulative
        text and tokens, read it before awaiting again); the last one has finished=True."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        state = RequestState.create(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                                    self.tokenizer)
        queue: asyncio.Queue[None] = asyncio.Queue()
        core = state.core_requests(self.max_model_len)
        spec = structured_spec(params)
        if self.fault is not None:
            raise EngineDeadError(self.fault, in_flight=False)
        if spec is not None:
            await self.prepare_structured(params)  # a first compile runs beside the event loop
            self.grammars.register([cid for cid, _ in core], spec)  # ValueError: bad grammar
        timer = None
        self._submit(state, core, queue)  # releases the matchers if it fails
        try:
            if self.request_timeout > 0:
                # One timer per request (not a wait_for per output): it aborts the request in the
                # engine, which frees its KV blocks, and wakes this generator to raise.
                timer = asyncio.get_running_loop().call_later(self.request_timeout, self._expire,
                                                              state, queue)
            while True:
                await queue.get()
                while not queue.empty():
                    queue.get_nowait()
                if state.timed_out:  # set only while unfinished; its abort may have landed since
                    raise RequestTimeoutError(f"the request ran longer than the server's request "
                                              f"timeout of {self.request_timeout:g} s")
                if self.fault is not None and not state.result.finished:
                    raise EngineDeadError(self.fault)
                # Read before yielding: the request may finish while the caller holds the
                # output, and the finished state must still be yielded once more then.
                finished = state.result.finished
                yield state.result
                if finished:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            if not state.result.finished and self.fault is None:
                self._abort_state(state)
            self._forget(state, core)

    def abort(self, request_id: str) -> None:
        with self._lock:
            state = self._by_request.get(request_id)
        if state is not None:
            self._abort_state(state)

    def shutdown(self) -> None:
        if not self._running:
            return
        self._running = False
        self._loop.stop()
        self._dispatcher.join(timeout=5)

    # ---- internals -------------------------------------------------------------------------
    def _expire(self, state: RequestState, queue: asyncio.Queue[None]) -> None:
        """Runs on the event loop when a request's timeout is up."""
        if state.result.finished:
            return
        state.timed_out = True
        logger.warning("request %s: timed out after %g s, aborted", state.request_id, self.request_timeout)
        self._abort_state(state)
        queue.put_nowait(None)

    def _fail(self, why: str) -> None:
        """The engine failed: every waiting generator raises EngineDeadError."""
        if self.fault is not None:
            return
        self.fault = why
        logger.error("engine failed: %s", why)
        with self._lock:
            owners = list(self._owner.values())
        for _, _, queue, loop in owners:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, None)
            except RuntimeError:  # the event loop is closed
                pass

    def _submit(self, state: RequestState, core: list[tuple[int, _C.SamplingParams]],
                queue: asyncio.Queue[None]) -> None:
        if not self._running:
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        with self._lock:
            for i, (core_id, _) in enumerate(core):
                self._owner[core_id] = (state, i, queue, loop)
            self._by_request[state.request_id] = state
        try:
            # n > 1: siblings fork from the first child and share the prompt's KV blocks.
            self._loop.add_request(core[0][0], state.prompt_token_ids, core[0][1], core[1:])  # ValueError
        except BaseException:
            for core_id, _ in core:
                self._loop.abort_request(core_id)
            self._forget(state, core)
            # The loop refuses once it has faulted, possibly before the dispatcher has told us.
            why = self._loop.fault()
            if why:
                self._fail(why)
                raise EngineDeadError(why, in_flight=False) from None
            raise

    def _abort_state(self, state: RequestState) -> None:
        for child in state.children:
            if child.output.finish_reason is None:
                self._loop.abort_request(child.core_id)

    def _forget(self, state: RequestState, core: list[tuple[int, Any]]) -> None:
        self.grammars.release([cid for cid, _ in core])
        with self._lock:
            for core_id, _ in core:
                self._owner.pop(core_id, None)
            if self._by_request.get(state.request_id) is state:
                del self._by_request[state.request_id]

    def _dispatch_forever(self) -> None:
        try:
            self._dispatch()
        except BaseException as exc:  # noqa: BLE001  (nothing would hand outputs on any more)
            self._fail(f"the output dispatcher died: {type(exc).__name__}: {exc}")
            raise

    def _dispatch(self) -> None:
        while self._running:
            outs = self._loop.wait_outputs(200)  # blocks in C++ without the GIL
            fault = self._loop.fault()  # published before the aborts it caused
            if fault:  # those aborts are not answers: the generators raise instead
                outs = [o for o in outs if not (o.finished and o.finish_reason == "abort")]
            if outs:
                self._hand_on(outs)
            if fault:
                self._fail(fault)
                return

    def _hand_on(self, outs: list[Any]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        with self._lock:
            for out in outs:
                entry = self._owner.get(out.request_id)
                if entry is not None:
                    by_loop.setdefault(entry[3], []).append((entry, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop is closed
                pass

    def _deliver(self, items: list[Any]) -> None:
        """Runs on the event loop: detokenize, apply stop strings, wake the generators."""
        woken: set[int] = set()
        for (state, index, queue, _), out in items:
            if state.result.finished:
                continue
            if state.apply(index, out):
                self._loop.abort_request(out.request_id)
            if id(queue) not in woken:
                woken.add(id(queue))
                queue.put_nowait(None)
