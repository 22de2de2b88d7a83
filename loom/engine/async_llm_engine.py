"""The engine for asyncio servers: `LLMEngine` steps on a thread of its own, so the event loop
never waits for the model, and each request's outputs arrive on a stream of its own.

A request is added from any coroutine (`add_request`, or `generate`), validated on the caller's
side (a bad one raises ValueError before anything is queued), and aborted when its stream is
closed unfinished: a cancelled task, a client gone. The step thread sleeps while there is
nothing to do.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from loom.engine.input_processor import Prompt
from loom.engine.llm_engine import LLMEngine
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step thread stopped (shut down, or a failure outside any request's step)."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        """`on_step(engine)` runs on the step thread once at start and after every step (metrics);
        `on_failure(error)` once, if the step thread stops on an error rather than a shutdown."""
        self.engine = engine
        self._on_step = on_step
        self._on_failure = on_failure
        self._lock = threading.Lock()  # guards _streams and _dead
        # request id -> (the loop its consumer runs on, its queue of outputs or one exception)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: BaseException | None = None
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="loom-engine", daemon=True)
        self._thread.start()

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished."""
        with self._lock:
            return len(self._streams)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str) -> RequestStream:
        """Validates and queues a request (a bad one raises ValueError and queues nothing);
        returns the stream of its outputs. Must be called on the event loop that reads it."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError("the engine has stopped") from self._dead
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(prompt, params, request_id)
        except BaseException:
            self._forget(request_id)
            raise
        self._wakeup.set()
        return RequestStream(self, request_id, queue)

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """`add_request`, then its outputs; leaving the iteration early aborts the request."""
        with self.add_request(prompt, params, request_id) as stream:
            async for output in stream:
                yield output

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._wakeup.set()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops the step thread after its current step; waiting consumers get EngineDeadError."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    # ---- the step thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._after_step()
            while not self._stopping:
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                self._deliver([(output.request_id, output) for output in self.engine.step()])
                self._after_step()
            error: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # a failure outside any request's step: nothing can go on
            logger.exception("the engine loop stopped")
            error = exc
        with self._lock:
            self._dead = error
            streams = list(self._streams)
        self._deliver([(request_id, error) for request_id in streams])
        if self._on_failure is not None and not isinstance(error, EngineDeadError):
            self._on_failure(error)

    def _after_step(self) -> None:
        if self._on_step is not None:
            try:
                self._on_step(self.engine)
            except Exception:  # an observer's failure must not stop the engine
                logger.exception("the step observer failed")

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hands each item to its request's stream: one wake-up of each consumer loop per step."""
        puts: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        with self._lock:
            for request_id, item in items:
                # A finished request's stream is dropped here, not only when its reader closes it: a
                # reader that never started (a client gone before its response began) leaks nothing.
                finished = isinstance(item, RequestOutput) and item.finished
                stream = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
                if stream is not None:  # None: its consumer left, and the abort is on its way
                    puts.setdefault(stream[0], []).append((stream[1], item))
        for loop, queued in puts.items():
            try:
                loop.call_soon_threadsafe(_put_all, queued)
            except RuntimeError:  # the consumer's loop is closed
                pass


def _put_all(queued: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, item in queued:
        queue.put_nowait(item)


class RequestStream:
    """One request's outputs, in order (what each holds follows its `output_kind`); the last has
    `finished` set. Closing the stream before then (leaving its `with` block, however) aborts
    the request, which frees its blocks."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineDeadError("the engine has stopped") from item
        self.finished = item.finished
        return item

    def close(self) -> None:
        self.engine._forget(self.request_id)
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
