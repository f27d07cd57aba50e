"""The front's errors in OpenAI's shape, and the HTTP status of each dgr error."""

from __future__ import annotations

import logging
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dgr import errors

__all__ = ["ApiError", "from_dgr", "mid_stream", "EXCEPTION_HANDLERS"]

log = logging.getLogger("dgr.serve")


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``type``, ``param`` and ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=self.headers)


def from_dgr(e: errors.DgrError, rid: str) -> ApiError:
    """The HTTP status of a dgr error met while serving request ``rid``. The route's message
    may name endpoints, sessions or paths: it goes to the log, and the client gets a generic
    message with ``rid`` and the error's class as the code."""
    name = type(e).__name__
    log.warning("request %s: %s: %s", rid, name, e)
    if isinstance(e, errors.ResourceExhausted):
        return ApiError(429, f"the route has no room for this request now; retry later "
                             f"(request {rid})", type="rate_limit_error", code=name,
                        headers={"Retry-After": "1"})
    if isinstance(e, (errors.WorkerUnavailable, errors.StepDeadlineExceeded,
                      errors.RouteError, errors.ModelMismatch)):
        return ApiError(503, f"the route is unavailable; retry later (request {rid})",
                        type="server_error", code=name)
    if isinstance(e, (errors.InvalidArgument, errors.InvalidToken, errors.ContextFull,
                      errors.InvalidPosition)) or isinstance(e, ValueError):
        return ApiError(400, f"the route refused this request: {name} (request {rid})",
                        code=name)
    return ApiError(500, f"internal error (request {rid})", type="server_error",
                    code="internal_error")


def mid_stream(e: Exception, rid: str) -> ApiError:
    """The error a stream ends with when request ``rid`` fails after its first event (call it
    in the ``except`` block): a dgr error as ``from_dgr`` says, anything else logged with its
    traceback and a 500 that names only the request."""
    if isinstance(e, errors.DgrError):
        return from_dgr(e, rid)
    log.exception("request %s failed mid-stream: %s: %s", rid, type(e).__name__, e)
    return ApiError(500, f"internal error (request {rid})", type="server_error",
                    code="internal_error")


async def _not_found(request: Request, exc) -> Response:
    return ApiError(404, f"no route {request.method} {request.url.path}",
                    code="not_found").response()


async def _method_not_allowed(request: Request, exc) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                    code="method_not_allowed").response()


async def _server_error(request: Request, exc) -> Response:
    # the exception's class and text stay in the log (uvicorn logs the traceback after)
    rid = "req-" + uuid.uuid4().hex
    log.error("request %s (%s %s) failed: %s: %s", rid, request.method, request.url.path,
              type(exc).__name__, exc)
    return ApiError(500, f"internal error (request {rid})", type="server_error",
                    code="internal_error", headers={"X-Request-Id": rid}).response()


#: the app's own 404, 405 and 500, in OpenAI's shape (``create_app``)
EXCEPTION_HANDLERS = {404: _not_found, 405: _method_not_allowed, 500: _server_error}
