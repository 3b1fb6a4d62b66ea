"""OpenAI-style error responses for every failure of the FastAPI application.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape). A full queue is a 429
with ``Retry-After``. Request problems are
400 ``invalid_request_error``: FastAPI's own body validation (``RequestValidationError``, a 422 by default) is
answered as a 400 naming the first offending field in ``param``. A 404/405 names the method and path; a 405
carries ``Allow`` (RFC 9110 15.5.6). Anything unexpected is a 500 ``server_error``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .scheduler import QueueFull, ShuttingDown
from .schemas import APIError


def as_api_error(e: BaseException) -> APIError:
    """The APIError to answer ``e`` with (503 for a shutdown, 500 for anything not already an APIError)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="shutting_down")
    return APIError(500, f"internal error ({type(e).__name__}: {e})")


def refused(e: QueueFull | ShuttingDown) -> APIError:
    """The answer to a job the scheduler refused: 429 ``rate_limit_exceeded`` with ``Retry-After`` (seconds) for a
    full queue, with OpenAI's body for a 429 (``type: "requests"``); 503 ``shutting_down`` for a server stopping."""
    if isinstance(e, QueueFull):
        return APIError(429, f"{e} (in about {e.retry_after} s)", type="requests", code="rate_limit_exceeded",
                        headers={"Retry-After": str(e.retry_after)})
    return APIError(503, str(e), code="shutting_down")


def validation_error(e: RequestValidationError) -> APIError:
    """A 400 naming the first field FastAPI's validation refused (``param`` as ``a.b[0]``, body prefix dropped)."""
    errors = e.errors()
    if not errors:
        return APIError(400, "the request is invalid")
    err = errors[0]
    loc = [x for x in err.get("loc", ()) if x not in ("body", "query", "path", "header")]
    param = "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else str(x)) for i, x in enumerate(loc))
    what = f"'{param}': " if param else ""
    return APIError(400, f"{what}{str(err.get('msg', 'invalid')).lower()}", param=param or None)


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, e: RequestValidationError):
        err = validation_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        headers = dict(e.headers or {})
        msg = str(e.detail)
        if e.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif e.status_code == 405:
            msg = f"{request.url.path} does not take {request.method} (it takes {headers.get('Allow', '?')})"
        return JSONResponse(APIError(e.status_code, msg).body(), status_code=e.status_code, headers=headers or None)

    @app.exception_handler(Exception)
    async def unexpected(_request, e: Exception):
        return JSONResponse(as_api_error(e).body(), status_code=500)


class CORS(CORSMiddleware):
    """FastAPI's CORS middleware whose refused preflight (an origin, method or header not allowed) is an OpenAI-style
    400 body naming the refused request header in ``param``, not a text/plain "Disallowed CORS origin"."""

    def preflight_response(self, request_headers):
        r = super().preflight_response(request_headers)
        if r.status_code != 400:
            return r
        what = r.body.decode().removeprefix("Disallowed CORS ")
        param = "origin" if what.startswith("origin") else f"access-control-request-{what.split(',')[0]}"
        err = APIError(400, f"CORS preflight refused: {what} not allowed (redraft serve --cors-origins)", param=param)
        headers = {k: v for k, v in r.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(err.body(), status_code=400, headers=headers)


def short_int(n: int) -> str:
    """``n`` for a message: as it is up to 12 digits, else as 1.00e+308 (a JSON 1e308 arrives as a 309-digit int,
    too large for a float once past ~1.8e308)."""
    digits = str(abs(n))
    if len(digits) <= 12:
        return str(n)
    return f"{'-' if n < 0 else ''}{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"
