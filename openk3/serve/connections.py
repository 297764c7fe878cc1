"""The HTTP connections of `openk3 serve`: uvicorn's h11 protocol with the limits it lacks, and its config.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection that opens and
sends nothing, or trickles a request's headers byte by byte, stays open for ever; past the process's file
descriptor limit `accept()` then fails and the server stops answering. `GuardedH11Protocol` adds:

- a deadline for a request's headers (`header_timeout_s`, from the connection's start or the request's first
  byte; not renewed by trickled bytes): past it the connection is closed;
- a cap on open connections (`max_connections`, default below the descriptor limit): one more is answered
  at once with a 503 in the error envelope and closed, and the refusals are logged once per 10 s, never
  per connection; asyncio accepts at most ACCEPT_BURST connections in one go (uvicorn's backlog), so that
  the descriptors in use stay under the limit; should they still run out, `quiet_accept_errors` (installed
  by the app's lifespan) logs that once per 10 s instead of a traceback per failed accept();
- TCP keepalive on every connection, so that a peer that vanished (power off, network gone) is noticed.

The time to read a request's body and its size are bounded in the app (`protocol.read_body`: 408, 413).

    config = uvicorn_config(app, host="127.0.0.1", port=8000)   # what `openk3 serve` runs
    uvicorn.Server(config).run()
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5  # uvicorn's own default: an idle connection between two requests
#: asyncio accepts up to `backlog` connections in one go before any of them reaches the protocol (and the cap):
#: uvicorn's 2048 opened descriptors past the limit. This bounds that burst (and the listen queue: a burst of
#: more new connections than this waits for the client's SYN retry, it is not refused).
ACCEPT_BURST = 128
_FD_RESERVE = 2 * ACCEPT_BURST  # descriptors left beside the cap: one accept burst, the engine's pipes, files
_LOG_EVERY_S = 10.0
REFUSAL_LINGER_S = 1.0


def _fd_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def default_max_connections() -> int:
    """Open connections allowed: below the soft descriptor limit by a reserve, at most 4096 (far beyond the
    requests in flight, `max_num_seqs + max_queue`)."""
    soft = _fd_limit()
    return max(16, min(4096, 4096 if soft is None else soft - _FD_RESERVE))


class _Every:
    """A log line at most once per `_LOG_EVERY_S`, counting the events it stands for."""

    def __init__(self) -> None:
        self.count, self.logged_at = 0, float("-inf")

    def due(self) -> int:
        """Count one event; the number to report when a line is due now, else 0."""
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at < _LOG_EVERY_S:
            return 0
        count, self.count, self.logged_at = self.count, 0, now
        return count


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs every failed accept() with its traceback, up to `backlog` times a second once descriptors
    run out (probe C4: about 3 MB/s of log); this exception handler says it in one line per 10 s instead."""
    every, previous = _Every(), loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            return previous(loop, context) if previous else loop.default_exception_handler(context)
        count = every.due()
        if count:
            log.warning("could not accept %d connection(s): %s; the file descriptor limit (ulimit -n %s) is "
                        "reached: lower --max-connections", count, context.get("exception"), _fd_limit())

    loop.set_exception_handler(handler)


def _refusal(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _keepalive(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):  # gone after ~2 min
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol plus a header deadline, a connection cap and TCP keepalive (module docstring).
    `guarded_protocol` makes a subclass with the limits set."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int = 1024
    refusals = _Every()  # guarded_protocol gives each server its own

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(transport)
            return
        _keepalive(transport)
        self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 and close. A lingering close: our side ends at once (FIN after the answer) while what the
        client sends meanwhile is read and dropped for up to REFUSAL_LINGER_S; closing with its request unread
        would reset the connection, and the client could lose the answer."""
        self._refused = True
        self.connections.discard(self)  # a refused connection does not count against the cap
        transport.write(_refusal(f"the server has {self.max_connections} connections open, its limit "
                                 "(openk3 serve --max-connections); retry later"))
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(REFUSAL_LINGER_S, transport.close)
        count = self.refusals.due()
        if count:
            log.warning("refused %d connection(s): %d open, the limit (--max-connections)", count,
                        self.max_connections)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request has begun and its headers have not all arrived
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE:
            log.debug("closing a connection whose request headers did not arrive within %g s", self.header_timeout_s)
            self.transport.close()


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int | None = None) -> type:
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    cap = max_connections or default_max_connections()
    soft = _fd_limit()
    if soft is not None and cap + _FD_RESERVE > soft:
        log.warning("max_connections %d leaves fewer than %d of the %d file descriptors (ulimit -n) for the rest: "
                    "past the limit new connections fail (and are logged once per 10 s)", cap, _FD_RESERVE, soft)
    limits = {"header_timeout_s": header_timeout_s, "max_connections": cap, "refusals": _Every()}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), limits)


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int | None = None,
                   keep_alive_s: int = KEEP_ALIVE_S, **kw: Any) -> uvicorn.Config:
    """The uvicorn.Config `openk3 serve` runs `app` with: the guarded h11 protocol (module docstring)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          http=guarded_protocol(header_timeout_s, max_connections), timeout_keep_alive=keep_alive_s,
                          backlog=ACCEPT_BURST, **kw)
