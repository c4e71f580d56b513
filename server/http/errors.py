"""OpenAI-style errors: one exception type, one body shape, handlers for everything else.

Every error response, whatever raised it, has the body
``{"error": {"message", "type", "param", "code"}}``. Validation errors become a
400 naming the offending field in ``message`` and ``param`` (never FastAPI's
422 dump); unknown routes are 404 and wrong methods 405 in the same shape; running out
of memory is a 503 (retry later, the request itself may be fine); an unexpected exception
is a 500 that does not leak internals. The handlers never
raise, so a bad request cannot take the server down.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_CUSTOM_ERROR_TYPES = {"empty", "unsupported", "range", "too_many"}


class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class APIError(Exception):
    """An error to return to the client as an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = dict(headers or {})
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    @staticmethod
    def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
        return APIError(400, message, param=param, code=code)

    @staticmethod
    def unavailable(message: str) -> APIError:
        return APIError(503, message, type="server_error", code="engine_unavailable")

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def validation_error(errors: list[Any]) -> APIError:
    """Summarise pydantic ``errors()`` as a 400 naming the first bad field.

    Errors our own validators raise are preferred (their messages are written for
    people); a value matching no member of a union gets one line, not one per member.
    """
    if not errors:
        return APIError.bad_request("invalid request body")
    custom = [e for e in errors if e.get("type") in _CUSTOM_ERROR_TYPES]
    first = custom[0] if custom else errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError.bad_request(f"request body is not valid JSON: {first.get('msg')}")
    if not loc:
        return APIError.bad_request(f"invalid request body: {first.get('msg')}")
    param = str(loc[0])
    same_field = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    if first.get("type") == "missing":
        message = f"'{param}' is a required field"
    elif not custom and len(same_field) > 1:
        message = f"'{param}' has an invalid type or value ({first.get('msg')})"
    else:
        message = f"'{param}': {first.get('msg')}"
    return APIError.bad_request(message, param=param)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _request_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError | ValidationError)
    return validation_error(list(exc.errors())).response()


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        error = APIError(404, f"Invalid URL ({request.method} {request.url.path})")
    elif exc.status_code == 405:
        error = APIError(405, f"Method {request.method} not allowed on {request.url.path}")
    else:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind)
    response = error.response()
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


async def _out_of_memory(request: Request, exc: Exception) -> JSONResponse:
    logger.warning("out of memory on %s %r", request.method, request.url.path)
    return APIError(
        503, "the server is out of memory for this request; retry later", type="server_error"
    ).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %r", request.method, request.url.path)
    return APIError(500, "internal server error", type="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can produce through the OpenAI error shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(ValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(MemoryError, _out_of_memory)
    app.add_exception_handler(Exception, _unexpected)
