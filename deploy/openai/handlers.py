"""The app's error handlers: every error a request meets, the server's own and the framework's,
answered as OpenAI's error JSON and counted by status and tenant."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from tierserve.deploy.openai.errors import (
    ApiError, BadField, error_response, param_path, server_error,
)

__all__ = ["error_handlers"]


def error_handlers(app: FastAPI, metrics) -> None:
    """Every error as OpenAI's error JSON, counted in `metrics` by status and tenant."""
    def refused(request: Request, status: int) -> None:
        tenant = getattr(request.state, "tenant", "")
        metrics.refused.labels(str(status), tenant).inc()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        refused(request, e.status)
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(BadField)
    async def _bad_field(request: Request, e: BadField):
        refused(request, 400)
        return error_response(400, str(e), e.param)

    @app.exception_handler(HTTPException)
    async def _framework(request: Request, e: HTTPException):
        """The framework's own errors (no such route, a method it does not take, a body it
        cannot parse), as OpenAI's error JSON."""
        refused(request, e.status_code)
        message = {404: f"no route {request.url.path}",
                   405: f"{request.url.path} does not take {request.method}"}.get(
            e.status_code, str(e.detail))
        return error_response(e.status_code, message, headers=e.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        refused(request, 500)
        err = server_error(500, f"internal error ({type(e).__name__})", e)
        return error_response(500, err.message, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        refused(request, 400)
        first = e.errors()[0] if e.errors() else {}
        param = param_path([str(p) for p in first.get("loc", ()) if p != "body"])
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                              param)
