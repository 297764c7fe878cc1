"""Turning a request's engine outputs into HTTP answers: a streamed SSE body or one JSON object.

`Collector` submits a request's choices (one engine request each) and yields `(choice index, output)`
from an asyncio queue the engine thread fills. Its `close()` aborts whatever is unfinished: streaming
generators and non-streaming handlers call it in `finally`, so a client that goes away (Starlette
cancels the response) frees its slots at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence

from openk3.infer.engine import RequestOutput
from openk3.infer.sample import SamplingParams
from openk3.serve.errors import APIError
from openk3.serve.loop import EngineLoop, LoopDead, QueueFull


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Collector:
    def __init__(self, loop: EngineLoop, requests: Sequence[tuple[list[int], SamplingParams]], *,
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> None:
        self.loop = loop
        self.rids = [new_id("req") for _ in requests]
        self.unfinished = set(range(len(requests)))
        self._queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        index = {rid: k for k, rid in enumerate(self.rids)}

        def deliver(out: RequestOutput | BaseException) -> None:  # on the engine thread
            k = index.get(out.request_id) if isinstance(out, RequestOutput) else None
            try:
                aloop.call_soon_threadsafe(self._queue.put_nowait, (k, out))
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        try:
            loop.submit([(rid, prompt, params) for rid, (prompt, params) in zip(self.rids, requests, strict=True)],
                        deliver, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        except LoopDead as e:
            raise APIError(503, str(e), code="engine_unavailable") from None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every choice has finished. An engine failure raises `EngineFailed`."""
        while self.unfinished:
            k, out = await self._queue.get()
            if isinstance(out, BaseException):
                self.unfinished.clear()
                raise EngineFailed(f"generation failed: {out}") from out
            if k not in self.unfinished:
                continue  # a choice finished here (a chat stop string) whose engine request ran one step more
            if out.finished:
                self.unfinished.discard(k)
            yield k, out

    def finish_early(self, k: int) -> None:
        """Choice k is complete before its engine request is (a chat stop string): drop the rest of it."""
        self.unfinished.discard(k)
        self.loop.abort(self.rids[k])

    def close(self) -> None:
        for k in list(self.unfinished):
            self.loop.abort(self.rids[k])
        self.unfinished.clear()


class EngineFailed(Exception):
    pass


def error_frame(message: str) -> str:
    """A mid-stream failure after the 200 was sent: an error event (the openai SDK raises APIError on it)."""
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": "engine_error"}})


async def watch_disconnect(receive) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request, coro):
    """Run a non-streaming handler's work, cancelling it when the client disconnects first (vLLM's
    `with_cancellation`): its `finally` then aborts the engine requests. Returns None on a disconnect."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(watch_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
    if work in done:
        return work.result()
    try:
        await work
    except asyncio.CancelledError:
        pass
    return None
