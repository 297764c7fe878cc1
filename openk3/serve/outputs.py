"""Turning a request's engine outputs into HTTP answers: a streamed SSE body or one JSON object.

`Collector` submits a request's choices (one engine request each) and yields `(choice index, output)`
from an asyncio queue that the engine loop fills (from the engine thread, or on the event loop itself
when the engine runs in its own process). Its `close()` aborts whatever is unfinished: streaming
generators and non-streaming handlers call it in `finally`, so a client that goes away (Starlette
cancels the response) frees its slots at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

from openk3.infer.engine import RequestOutput
from openk3.infer.sample import SamplingParams
from openk3.serve.errors import APIError
from openk3.serve.loop import LoopDead, QueueFull


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


#: An SSE comment, sent while a stream has had nothing to send for `--sse-keepalive` seconds (a long prefill):
#: proxies with a read timeout keep the connection, and clients' SSE parsers skip comment lines.
KEEPALIVE = ": keep-alive\n\n"


class Collector:
    def __init__(self, loop, requests: Sequence[tuple[list[int], SamplingParams]], *,
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> None:
        self.loop = loop
        self.rids = [new_id("req") for _ in requests]
        self.unfinished = set(range(len(requests)))
        self._queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()
        index = {rid: k for k, rid in enumerate(self.rids)}

        def deliver(out: RequestOutput | BaseException) -> None:  # on the engine thread or on the event loop
            k = index.get(out.request_id) if isinstance(out, RequestOutput) else None
            if threading.get_ident() == loop_thread:  # the engine process's outputs: no wake-up needed
                self._queue.put_nowait((k, out))
                return
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

    async def outputs(self, keepalive_s: float | None = None) -> AsyncIterator[tuple[int, RequestOutput | None]]:
        """(choice index, output) until every choice has finished. An engine failure raises `EngineFailed`.
        With `keepalive_s`, (-1, None) whenever that long passes with no output (a stream sends KEEPALIVE then)."""
        while self.unfinished:
            if keepalive_s is None or not self._queue.empty():  # (wait_for costs a task per call: only when idle)
                k, out = await self._queue.get()
            else:
                try:
                    k, out = await asyncio.wait_for(self._queue.get(), keepalive_s)
                except asyncio.TimeoutError:
                    yield -1, None
                    continue
            if isinstance(out, BaseException):
                self.unfinished.clear()
                raise EngineFailed(out) from out
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


# ---- log probabilities ------------------------------------------------------------------------------------

#: JSON has no -Infinity: a token the model rules out (a -inf logit) reports this instead, as vLLM does.
LOGPROB_FLOOR = -9999.0


def token_piece(tok, token_id: int) -> bytes:
    """A token's bytes (a special token's name as UTF-8). An id of the model's vocabulary that the tokenizer
    does not have (a padded embedding table) can still appear among the top alternatives: it gets a
    placeholder name rather than failing the response."""
    try:
        return tok.decode_bytes([token_id])
    except ValueError:
        return f"<|token_{token_id}|>".encode()


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(tok, token_ids: Sequence[int], entries: Sequence) -> list[dict]:
    """Chat `logprobs.content` items: per token its text (a partial UTF-8 character shows as U+FFFD, `bytes`
    has the exact bytes), log probability, and `top_logprobs` (the k most likely tokens, k as asked)."""
    def item(tid: int, lp: float) -> dict:
        piece = token_piece(tok, tid)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": _logprob(lp), "bytes": list(piece)}

    return [{**item(tid, lp), "top_logprobs": [item(i, v) for i, v in top]}
            for tid, (lp, top) in zip(token_ids, entries, strict=True)]


def completion_logprobs(tok, token_ids: Sequence[int], entries: Sequence, offset: int) -> dict:
    """The legacy completions `logprobs` object for these tokens; `offset` is the text offset of the first.
    `top_logprobs` maps token text to log probability for the k most likely tokens and always the sampled
    one (the legacy API's "up to logprobs + 1" entries)."""
    tokens = [token_piece(tok, t).decode("utf-8", errors="replace") for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops = []
    for text, (lp, top) in zip(tokens, entries, strict=True):
        d = {token_piece(tok, i).decode("utf-8", errors="replace"): _logprob(v) for i, v in top}
        d.setdefault(text, _logprob(lp))
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": [_logprob(lp) for lp, _ in entries], "top_logprobs": tops,
            "text_offset": offsets}


class EngineFailed(Exception):
    """A request's generation failed after admission. `status`/`code`: 503 `engine_unavailable` when the engine
    is gone (shut down, or its process died: nothing is generating any more), else 500 `engine_error` (the step
    that generated it raised; other requests go on)."""

    def __init__(self, cause: BaseException) -> None:
        gone = isinstance(cause, LoopDead)
        super().__init__(f"{'the engine is unavailable' if gone else 'generation failed'}: {cause}")
        self.status, self.code = (503, "engine_unavailable") if gone else (500, "engine_error")

    def api_error(self) -> APIError:
        return APIError(self.status, str(self), code=self.code)


def error_frame(error: EngineFailed) -> str:
    """A mid-stream failure after the 200 was sent: an error event (the openai SDK raises APIError on it)."""
    return sse({"error": {"message": str(error), "type": "server_error", "param": None, "code": error.code}})


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
