"""The OpenAI error envelope, `{"error": {"message", "type", "param", "code"}}`, for every error the server
answers (next-agents-serving.md §3.7): the status stays in the HTTP status line, `code` is a string or null.

Handlers replace FastAPI's defaults, whose `{"detail": ...}` shape clients cannot read: request validation
(422 -> 400), Starlette's HTTP errors (unknown route 404, wrong method 405, unparsable body 400), a client
that disconnects mid-body (one log line, no traceback) and, as a last resort, any other exception (500,
logged with its traceback).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An error answered as the envelope. `param` names the request field at fault, when there is one."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if self.status in (408, 413):  # the rest of the body is not read: the connection cannot carry another request
            headers = {"Connection": "close"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        return bad_request(f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid request')}",
                           param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, message, code=code).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # A client that hung up while sending its body: one line, no traceback (nothing is wrong here).
        log.info("%s %s: the client disconnected before its request body had arrived", request.method,
                 request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
