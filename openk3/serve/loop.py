"""One background thread drives one `Engine`; asyncio handlers submit requests and receive their outputs.

The engine is single-threaded (`openk3/infer/engine.py`), so only this thread calls `add_request` and
`step`: handlers put submissions in an inbox and the thread adds them between steps, so requests join and
leave the running batch as they come (continuous batching). Each request's `RequestOutput`s are handed
to its `deliver` callback on the engine thread; the handlers' callbacks forward them to an asyncio queue
with `call_soon_threadsafe`.

Admission is bounded: at most `max_num_seqs + max_queue` requests in flight (running or waiting); one
more is refused at once with `QueueFull` (the server answers 429) instead of queueing without limit.
`abort` (a client went away) removes a request that is still in the inbox, or asks the engine to drop it
at its next step boundary, which frees its slot.

A step that raises fails the requests it was working on (`guarded_step`: they get `StepFailed`, the
server answers a 500-class error for them) and the loop goes on with the others and with new requests.

This in-thread loop is the twin of `process.EngineProcess` (the engine in its own process, the default
of `openk3 serve`): `create_app` uses it for an in-memory `LLM` or `Engine`, or when asked to
(`--engine-in-thread`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from openk3.infer.engine import Engine, RequestOutput
from openk3.infer.sample import SamplingParams
from openk3.serve.metrics import Metrics

log = logging.getLogger(__name__)

Deliver = Callable[[RequestOutput | BaseException], None]


class QueueFull(Exception):
    """More requests than the server admits (`max_num_seqs + max_queue` in flight)."""


class LoopDead(Exception):
    """The engine has stopped (shut down, or crashed: the cause is logged). The server answers 503."""


class StepFailed(Exception):
    """The engine step that was generating this request raised (an internal error: the server answers 500)."""


def expert_stats(engine: Engine) -> dict | None:
    """The streamed experts' counters of the engine's model (`openk3.stream.stats`), None without them."""
    cache = engine.model.__dict__.get("expert_stream")
    return None if cache is None else cache.stats()


def guarded_step(engine: Engine) -> tuple[list[RequestOutput], list[tuple[str, Exception]]]:
    """`engine.step()`; when it raises, the requests that step was working on fail, the others keep going.

    Returns the step's outputs and the failed requests' (id, exception). A step that raised may have
    advanced the running requests' caches without taking their tokens, and may have stopped in the middle
    of a prefill: those requests (every running one, and a waiting one whose prefill has begun) cannot go on
    and are aborted (their slots are freed at the next step); requests still waiting untouched keep their
    place. When no request can be blamed the engine itself is broken, and the exception propagates.
    """
    try:
        return engine.step(), []
    except Exception as e:
        hit = [r.id for r in engine.running] + [r.id for r in engine.waiting if r.cache is not None or r.prefilled]
        if not hit:
            raise
        log.exception("an engine step failed: failing its %d request(s), serving the others", len(hit))
        for rid in hit:
            engine.abort(rid)
        return [], [(rid, e) for rid in hit]


@dataclass
class _Submission:
    rid: str
    prompt: list[int]
    params: SamplingParams
    deliver: Deliver
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    first_seen: bool = False


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics, *, max_queue: int = 256) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._cv = threading.Condition()
        self._inbox: list[_Submission] = []
        self._live: dict[str, _Submission] = {}  # submitted and not finished: the in-flight count
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="openk3-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight are told the loop is gone."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(LoopDead("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def healthy(self) -> bool:
        """What /health answers (the thread shares this process: alive is all there is to know)."""
        return self.alive

    @property
    def capacity(self) -> int:
        """The most engine requests ever admitted at once (`max_num_seqs + max_queue`)."""
        return self.engine.max_num_seqs + self.max_queue

    def stopped(self) -> bool:
        """The thread has ended (or never started)."""
        return self._thread is None or not self._thread.is_alive()

    # ---- requests (any thread) ------------------------------------------------------------------

    def submit(self, requests: Sequence[tuple[str, list[int], SamplingParams]], deliver: Deliver, *,
               stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> None:
        """Admit all of `requests` (rid, prompt ids, params) or none: the choices of one HTTP request are
        scheduled together."""
        with self._cv:
            if not self.alive:
                raise LoopDead("the engine is not running" + (f" ({self.error!r})" if self.error else ""))
            room = self.engine.max_num_seqs + self.max_queue - len(self._live)
            if len(requests) > room:
                self.metrics.reject("queue_full")
                raise QueueFull(f"the server is at capacity ({len(self._live)} requests in flight, "
                                f"max_num_seqs {self.engine.max_num_seqs} + max_queue {self.max_queue}); "
                                "retry later")
            for rid, prompt, params in requests:
                sub = _Submission(rid, prompt, params, deliver, tuple(stop_token_ids), ignore_eos)
                self._live[rid] = sub
                self._inbox.append(sub)
            self._cv.notify_all()

    def abort(self, rid: str) -> None:
        """Drop a request (thread-safe). A request still in the inbox never reaches the engine."""
        with self._cv:
            sub = self._live.get(rid)
            if sub is None:
                return
            if sub in self._inbox:
                self._inbox.remove(sub)
                del self._live[rid]
                self.metrics.finished("abort")
                return
            self.engine.abort(rid)
            self._cv.notify_all()

    def in_flight(self) -> int:
        with self._cv:
            return len(self._live)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self._inbox and not self.engine.has_unfinished():
                        self._cv.wait()
                    if self._stopping:
                        return
                    new, self._inbox = self._inbox, []
                for sub in new:
                    self._add(sub)
                self._step()
        except BaseException as e:  # a broken engine (no request to blame) or a bug: every waiting client hears of it
            self.error = e
            log.exception("the engine loop failed")
            self._fail_all(LoopDead(f"the engine loop failed ({e!r})"))
        finally:
            with self._cv:
                self._stopping = True

    def _add(self, sub: _Submission) -> None:
        try:
            self.engine.add_request(sub.prompt, sub.params, request_id=sub.rid, stop_token_ids=sub.stop_token_ids,
                                    ignore_eos=sub.ignore_eos, on_output=lambda out, sub=sub: self._on_output(sub, out))
        except ValueError as e:  # the handlers check prompts first; this is a last line, not the usual path
            with self._cv:
                self._live.pop(sub.rid, None)
            sub.deliver(e)

    def _step(self) -> None:
        stats = self.engine.stats
        before = stats["generation_tokens"], stats["prompt_tokens"]
        _, failed = guarded_step(self.engine)
        self.metrics.step(len(self.engine.running), len(self.engine.waiting),
                          stats["generation_tokens"] - before[0], stats["prompt_tokens"] - before[1],
                          expert_stats(self.engine))
        for rid, error in failed:
            with self._cv:
                sub = self._live.pop(rid, None)
            if sub is not None:  # else it finished within the failed step, before the error
                self.metrics.finished("error")
                sub.deliver(StepFailed(f"{type(error).__name__}: {error}"))

    def _on_output(self, sub: _Submission, out: RequestOutput) -> None:
        if self._live.get(sub.rid) is not sub:
            return  # failed already (a step error): its abort output is not news to anyone
        if not sub.first_seen and out.delta_token_ids:
            sub.first_seen = True
            self.metrics.first_token(time.perf_counter() - sub.t_submit)
        if out.finished:
            with self._cv:
                self._live.pop(sub.rid, None)
            self.metrics.finished(out.finish_reason or "stop")
        sub.deliver(out)

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            subs, self._live, self._inbox = list(self._live.values()), {}, []
        for sub in subs:
            sub.deliver(error)
