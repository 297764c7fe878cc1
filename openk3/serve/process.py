"""The engine in its own process (the default of `openk3 serve`; vLLM V1's engine-core split).

Why: the engine's decode step is mostly Python at small shapes, and the HTTP side's per-chunk work
(starlette, uvicorn, h11, JSON) shares the GIL with it when both live in one process, so every chunk
sent adds to the step time (docs/benchmarks.md, serving). Here the engine process only steps; the HTTP
process renders prompts, parses and frames outputs, and the two run on different cores.

    parent (HTTP, asyncio)                           child (python -m openk3.serve.engine_main: torch, model)
    EngineProcess.submit/abort --- inbox pipe ---->  reader thread -> queue -> main loop: add_request,
                                                     abort, step
    asyncio reader callback    <-- outbox pipe ----  one message per step: every request's new token
      rebuilds RequestOutputs, delivers them          ids, text, logprobs and finish reason, the step's
                                                      failures and its running/waiting/token counts

The child's text (delta_text, stop strings) is the engine's own `TextStream`, as in-process; the parent
keeps the cumulative fields (token_ids, text, logprobs) so that a step's message carries deltas only.

The child is built by calling `build` (a picklable callable returning an `Engine` or an `openk3.LLM`:
a module-level function or a `functools.partial` of one) after `setup_cpu(threads)`. It ignores SIGINT
(the parent decides when to stop) and exits when the parent says "stop" or when the inbox pipe closes,
which is also what a killed parent leaves behind: no orphan engine. The child's inbox is read by a thread
of its own, so the parent's writes never wait for a step to end (and the two processes cannot block
on each other's full pipes).

If the child dies, the parent sees the outbox close: every request in flight fails with `LoopDead`
(the server answers 503 `engine_unavailable`), /health answers 503, and new requests are refused. A child
that lives but cannot run (stopped with SIGSTOP, starved) closes nothing: a thread of the child sends a
heartbeat every HEARTBEAT_S, and `healthy()` (what /health answers) is false once nothing at all has come
for `heartbeat_timeout_s`; requests are still admitted then (the child may go on).
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from openk3.infer.engine import RequestOutput
from openk3.infer.sample import SamplingParams
from openk3.serve.loop import Deliver, LoopDead, QueueFull, StepFailed, expert_stats, guarded_step
from openk3.serve.metrics import Metrics

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a step in progress finishes before the child reads "stop"
#: /health answers 503 once the child has sent nothing (not even its heartbeat, every HEARTBEAT_S) this long.
HEARTBEAT_TIMEOUT_S = 20.0
HEARTBEAT_S = 1.0


@dataclass
class EngineInfo:
    """What the HTTP side needs to know about the engine the child built."""

    tok: object
    vocab_size: int
    max_model_len: int
    max_num_seqs: int


@dataclass
class _Live:
    """A request in flight, seen from the parent: its callback and the cumulative parts of its outputs."""

    rid: str
    prompt: list[int]
    deliver: Deliver
    t_submit: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    first_seen: bool = False


class EngineStartError(RuntimeError):
    """The child could not build the engine (its traceback is in the message)."""


# ---- the child ----------------------------------------------------------------------------------------


def child_main(inbox_fd: int, outbox_fd: int) -> None:
    """The engine process (`python -m openk3.serve.engine_main INBOX_FD OUTBOX_FD`): read how to build the engine,
    build it, report ready (or why not), then serve the inbox until told to stop or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    inbox, outbox = Connection(inbox_fd, writable=False), Connection(outbox_fd, readable=False)
    try:
        # The parent's import path first (the builder may live in a module only it can see, a test helper),
        # then the builder itself, unpickled with that path in place.
        sys.path[:] = inbox.recv()
        build, threads, log_level, beat_s = inbox.recv()
    except EOFError:
        return
    logging.basicConfig(level=log_level, format="%(levelname)s: [engine] %(name)s: %(message)s")
    try:
        from openk3.common import setup_cpu

        setup_cpu(threads)
        engine = build()
        engine = getattr(engine, "engine", engine)  # an openk3.LLM
        if engine.tok is None:
            raise ValueError("the server needs a tokenizer: give the LLM or Engine one")
        info = EngineInfo(engine.tok, engine.cfg.vocab_size, engine.max_model_len, engine.max_num_seqs)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the parent must hear of it
        outbox.send(("failed", type(e).__name__, str(e), traceback.format_exc()))
        return
    outbox.send(("ready", info))
    messages: queue.SimpleQueue = queue.SimpleQueue()
    lock = threading.Lock()  # the heartbeat thread and the main loop share the outbox

    def send(msg: tuple) -> None:
        with lock:
            outbox.send(msg)

    def beat() -> None:  # a thread: it goes on through long steps, and stops only with the whole process
        try:
            while True:
                time.sleep(beat_s)
                send(("beat",))
        except (OSError, ValueError):  # the outbox is closed: this process is ending
            pass

    def read() -> None:
        try:
            while True:
                messages.put(inbox.recv())
        except (EOFError, OSError):  # the parent closed its end or died
            messages.put(("stop",))

    threading.Thread(target=read, name="openk3-engine-inbox", daemon=True).start()
    threading.Thread(target=beat, name="openk3-engine-heartbeat", daemon=True).start()
    try:
        _serve(engine, messages, send)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass  # the parent went away mid-send: nobody is left to answer
    finally:
        # (a heartbeat blocked on a full pipe, with nobody reading, must not keep this process: exiting closes it)
        if lock.acquire(timeout=5):
            outbox.close()


def _serve(engine, messages: queue.SimpleQueue, send: Callable[[tuple], None]) -> None:
    stats = engine.stats
    while True:
        # Idle: wait for the next message. Busy: take whatever arrived during the last step, then step.
        pending = [messages.get()] if not engine.has_unfinished() else []
        while True:
            try:
                pending.append(messages.get_nowait())
            except queue.Empty:
                break
        failures: list[tuple[str, str]] = []
        for msg in pending:
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                engine.abort(msg[1])
            else:  # ("add", [(rid, prompt, params)], stop_token_ids, ignore_eos)
                _, requests, stop_ids, ignore_eos = msg
                for rid, prompt, params in requests:
                    try:
                        engine.add_request(prompt, params, request_id=rid, stop_token_ids=stop_ids,
                                           ignore_eos=ignore_eos)
                    except ValueError as e:  # the handlers check prompts first: a last line, not the usual path
                        failures.append((rid, f"{type(e).__name__}: {e}"))
        if not engine.has_unfinished():
            if failures:
                send(("step", len(engine.running), len(engine.waiting), 0, 0, [], failures, expert_stats(engine)))
            continue
        before = stats["generation_tokens"], stats["prompt_tokens"]
        outputs, failed = guarded_step(engine)
        failures += [(rid, f"{type(e).__name__}: {e}") for rid, e in failed]
        outs = [(o.request_id, o.delta_token_ids, o.delta_text, o.finish_reason if o.finished else None,
                 o.stop_reason, o.delta_logprobs) for o in outputs]
        send(("step", len(engine.running), len(engine.waiting), stats["generation_tokens"] - before[0],
              stats["prompt_tokens"] - before[1], outs, failures, expert_stats(engine)))


# ---- the parent ---------------------------------------------------------------------------------------


def _shutdown(proc: subprocess.Popen, conns) -> None:
    """Stop the child (used by `stop` and, for an app that was never served or never stopped, at exit)."""
    inbox = conns[0]
    try:
        inbox.send(("stop",))
    except (OSError, ValueError):
        pass
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # stuck in a step: ask, then insist
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for c in conns:
        c.close()


class EngineProcess:
    """The same interface as `loop.EngineLoop` (submit, abort, in_flight, alive, start, stop), over an
    engine in a child process. The constructor starts the child and waits until the engine is built:
    `info` then says what the HTTP side needs (tokenizer, vocabulary, limits). `start()` runs in the
    event loop that serves the app (the app's lifespan): outputs are delivered on that loop's thread."""

    def __init__(self, build: Callable, metrics: Metrics, *, max_queue: int = 256, threads: int | None = None,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        try:
            pickle.dumps(build)
        except Exception as e:
            raise TypeError(f"the engine builder must be picklable for the engine process (a module-level "
                            f"function or a functools.partial of one), got {build!r}: {e}") from None
        self.metrics = metrics
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._dead = False  # the child is gone (or was stopped): nothing more will come from it
        self.error: str | None = None
        # A fresh interpreter (`python -m`), not multiprocessing's spawn: spawn would re-run the parent's main
        # script in the child, which a script without a __main__ guard cannot survive.
        inbox_r, inbox_w = os.pipe()
        outbox_r, outbox_w = os.pipe()
        self._inbox, self._outbox = Connection(inbox_w, readable=False), Connection(outbox_r, writable=False)
        self._proc = subprocess.Popen([sys.executable, "-m", "openk3.serve.engine_main", str(inbox_r), str(outbox_w)],
                                      pass_fds=(inbox_r, outbox_w))
        # Only the child holds these ends now, so its death closes the outbox (EOF here) and ours closes its inbox.
        os.close(inbox_r)
        os.close(outbox_w)
        self._finalizer = weakref.finalize(self, _shutdown, self._proc, (self._inbox, self._outbox))
        try:
            self._inbox.send(list(sys.path))
            self._inbox.send((build, threads, logging.getLogger().getEffectiveLevel(),
                              min(HEARTBEAT_S, heartbeat_timeout_s / 4)))
            msg = self._outbox.recv()
        except (EOFError, OSError):
            self._finalizer()
            raise EngineStartError(f"the engine process exited with code {self._proc.returncode} before it was "
                                   "ready (see its output above)") from None
        except BaseException:  # Ctrl-C while the model loads: the child ignores SIGINT and reads no "stop" yet
            self._proc.kill()
            self._finalizer()
            raise
        if msg[0] == "failed":
            self._finalizer()
            _, kind, message, tb = msg
            log.debug("the engine process failed to start:\n%s", tb)
            builtin = getattr(builtins, kind, None)
            # A user error (a bad checkpoint path, a bad option) keeps its type, so callers (the CLI) report it
            # as such; anything else carries the child's traceback.
            if isinstance(builtin, type) and issubclass(builtin, (ValueError, OSError, TypeError)):
                raise builtin(message)
            raise EngineStartError(f"the engine process failed to start: {kind}: {message}\n{tb}")
        self.info: EngineInfo = msg[1]
        self.max_num_seqs = self.info.max_num_seqs
        self._heard = time.monotonic()  # when the child last sent anything (a step, or its heartbeat)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start delivering outputs on the running event loop (call from inside it)."""
        self._aloop = asyncio.get_running_loop()
        self._aloop.add_reader(self._outbox.fileno(), self._on_readable)
        self._heard = time.monotonic()

    def stop(self) -> None:
        """Stop the child after its current step (at most STOP_TIMEOUT_S, then it is terminated); requests still
        in flight are told the engine is gone."""
        self._detach()
        self._dead = True
        self._finalizer()
        self._fail_all(LoopDead("the server is shutting down"))

    def _detach(self) -> None:
        if self._aloop is not None and not self._outbox.closed:
            self._aloop.remove_reader(self._outbox.fileno())
        self._aloop = None

    @property
    def alive(self) -> bool:
        return not self._dead and self._proc.poll() is None

    def healthy(self) -> bool:
        """Alive, and heard from within `heartbeat_timeout_s` (what /health answers). A stopped child (SIGSTOP)
        or one that cannot run sends no heartbeat; new requests are still admitted (it may go on)."""
        if self._aloop is not None:
            self._on_readable()  # what arrived while the event loop was busy is news, not silence
        return self.alive and time.monotonic() - self._heard < self.heartbeat_timeout_s

    @property
    def capacity(self) -> int:
        """The most engine requests ever admitted at once (`max_num_seqs + max_queue`)."""
        return self.max_num_seqs + self.max_queue

    def stopped(self) -> bool:
        """The child has exited (tests: nothing is left running after a shutdown)."""
        return self._proc.poll() is not None

    # ---- requests (the event loop's thread, or any) ---------------------------------------------

    def submit(self, requests: Sequence[tuple[str, list[int], SamplingParams]], deliver: Deliver, *,
               stop_token_ids: Sequence[int] = (), ignore_eos: bool = False) -> None:
        """Admit all of `requests` (rid, prompt ids, params) or none, as `EngineLoop.submit`."""
        with self._lock:
            if not self.alive:
                raise LoopDead("the engine is not running" + (f" ({self.error})" if self.error else ""))
            room = self.max_num_seqs + self.max_queue - len(self._live)
            if len(requests) > room:
                self.metrics.reject("queue_full")
                raise QueueFull(f"the server is at capacity ({len(self._live)} requests in flight, "
                                f"max_num_seqs {self.max_num_seqs} + max_queue {self.max_queue}); retry later")
            for rid, prompt, _ in requests:
                self._live[rid] = _Live(rid, prompt, deliver)
            try:
                self._inbox.send(("add", list(requests), tuple(stop_token_ids), ignore_eos))
            except OSError as e:  # the child died just now
                for rid, _, _ in requests:
                    self._live.pop(rid, None)
                raise LoopDead(f"the engine process is gone ({e})") from None

    def abort(self, rid: str) -> None:
        """Drop a request: the child aborts it at its next step boundary and reports it (freeing the slot)."""
        with self._lock:
            if rid not in self._live or self._dead:
                return
            try:
                self._inbox.send(("abort", rid))
            except OSError:
                pass  # the child is gone: the outbox's EOF fails every request

    def in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    # ---- outputs (the event loop's thread) ------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            while self._outbox.poll():
                msg = self._outbox.recv()
                self._heard = time.monotonic()
                if msg[0] != "beat":
                    self._on_message(msg)
        except (EOFError, OSError) as e:
            self._on_child_death(e)

    def _on_message(self, msg: tuple) -> None:
        _, running, waiting, new_tokens, new_prompt, outs, failures, experts = msg
        self.metrics.step(running, waiting, new_tokens, new_prompt, experts)
        for rid, delta_ids, delta_text, finish_reason, stop_reason, delta_lp in outs:
            live = self._live.get(rid)
            if live is not None:  # else: failed already, or a late output of an abort
                self._on_output(live, self._output(live, delta_ids, delta_text, finish_reason, stop_reason, delta_lp))
        for rid, message in failures:
            with self._lock:
                live = self._live.pop(rid, None)
            if live is not None:
                self.metrics.finished("error")
                live.deliver(StepFailed(message))

    @staticmethod
    def _output(live: _Live, delta_ids, delta_text, finish_reason, stop_reason, delta_lp) -> RequestOutput:
        live.token_ids += delta_ids
        live.text += delta_text
        if delta_lp is not None:
            live.logprobs = (live.logprobs or []) + delta_lp
        return RequestOutput(live.rid, live.prompt, list(live.token_ids), live.text, delta_ids, delta_text,
                             finish_reason is not None, finish_reason, stop_reason,
                             {"prompt_tokens": len(live.prompt), "generation_tokens": len(live.token_ids)},
                             None if live.logprobs is None else list(live.logprobs), delta_lp)

    def _on_output(self, live: _Live, out: RequestOutput) -> None:
        """One request's output (a hook: the load test records the final ones here)."""
        if not live.first_seen and out.delta_token_ids:
            live.first_seen = True
            self.metrics.first_token(time.perf_counter() - live.t_submit)
        if out.finished:
            with self._lock:
                self._live.pop(live.rid, None)
            self.metrics.finished(out.finish_reason or "stop")
        live.deliver(out)

    def _on_child_death(self, cause: BaseException) -> None:
        self._detach()
        if self._dead:
            return
        self._dead = True
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:  # it closed its pipe but lives on, stuck: it is of no use any more
            self._proc.kill()
            code = self._proc.wait()
        self.error = f"the engine process exited with code {code}"
        log.error("%s (%s): failing the requests in flight", self.error, type(cause).__name__)
        self._fail_all(LoopDead(self.error))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            lives, self._live = list(self._live.values()), {}
        for live in lives:
            live.deliver(error)
