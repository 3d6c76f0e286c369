"""The control API: a FastAPI app served by Ray Serve (one replica, no CPU reserved).

The app holds no run state: every route validates the request (Pydantic, unknown fields and
negative counts are 422s with a message naming the field), checks the bearer token when one is
set, and asks the hub actor (:mod:`relax.core.control.state`), which the driver keeps current.
Nothing user-supplied is executed or imported: requests are data (counts, ids, URLs).
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from ray import serve

from relax.core.control import prometheus
from relax.core.control.models import OperationInfo, ScaleInRequest, ScaleOutRequest, StatusResponse
from relax.core.control.state import ControlError

NAMESPACE = "relax"


class HubError(Exception):
    def __init__(self, error: ControlError) -> None:
        self.error = error


def _readable(exc: RequestValidationError) -> str:
    """One line per problem, naming the field: ``num_engines: Input should be greater than or equal to 1``."""
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        msg = "unknown field" if err.get("type") == "extra_forbidden" else err.get("msg", "invalid")
        parts.append(f"{where}: {msg.removeprefix('Value error, ')}")
    return "; ".join(parts)


def build_app(hub_name: str, token: str | None) -> FastAPI:
    import ray

    bearer = HTTPBearer(auto_error=False)

    def authorized(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if token and (creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode())):
            raise HubError(
                ControlError(
                    401, "missing or wrong bearer token (send Authorization: Bearer <control token>)"
                )
            )

    app = FastAPI(
        title="Relax control plane",
        version="1",
        description="Status, metrics and elastic rollout of a running Relax run.",
        dependencies=[Depends(authorized)],
    )
    hub: list[Any] = []

    async def ask(method: str, *args: Any) -> Any:
        if not hub:
            hub.append(ray.get_actor(hub_name, namespace=NAMESPACE))
        try:
            return await getattr(hub[0], method).remote(*args)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ControlError):
                raise HubError(cause) from None
            raise

    @app.exception_handler(HubError)
    async def _hub_error(request: Request, exc: HubError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.error.status == 401 else None
        return JSONResponse({"detail": exc.error.detail}, status_code=exc.error.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _readable(exc)}, status_code=422)

    @app.get("/status", response_model=StatusResponse)
    async def status() -> dict:
        """Mode, step, weight version, engines (health, load), queue depths, trainer idle fraction."""
        return await ask("status")

    @app.get("/engines")
    async def engines() -> dict:
        return {"engines": await ask("engines")}

    @app.get("/metrics", response_model=None)
    async def metrics(request: Request, format: str | None = None) -> Any:
        """The latest step's metrics as JSON, or Prometheus text with ``?format=prometheus`` or an
        ``Accept`` header asking for text/plain or OpenMetrics (what Prometheus sends)."""
        accept = request.headers.get("accept", "")
        snapshot = await ask("status")
        values = {**snapshot.get("metrics", {}), **prometheus.run_gauges(snapshot)}
        if format == "prometheus" or (format is None and ("text/plain" in accept or "openmetrics" in accept)):
            body = prometheus.exposition(values, snapshot.get("name") or "relax")
            return PlainTextResponse(body, media_type=prometheus.CONTENT_TYPE)
        if format not in (None, "json"):
            raise HubError(
                ControlError(400, f"format: {format!r} is not allowed; allowed values: 'json', 'prometheus'")
            )
        return {"step": snapshot.get("step"), "metrics": values}

    @app.post("/pause", status_code=202, response_model=OperationInfo)
    async def pause() -> dict:
        """Stop starting new steps (the current one finishes); engines can still be scaled."""
        return await ask("submit", "pause", {})

    @app.post("/resume", status_code=202, response_model=OperationInfo)
    async def resume() -> dict:
        return await ask("submit", "resume", {})

    @app.post("/checkpoint", status_code=202, response_model=OperationInfo)
    async def checkpoint() -> dict:
        """Save a checkpoint after the current step; the operation's result names its directory."""
        return await ask("submit", "checkpoint", {})

    @app.post("/engines/scale_out", status_code=202, response_model=OperationInfo)
    async def scale_out(body: ScaleOutRequest) -> dict:
        """Add engines; poll ``/operations/{id}`` (pending, creating, health-checking, weight-syncing,
        active | failed | cancelled). One scale operation at a time (409 otherwise)."""
        return await ask("submit", "scale_out", body.model_dump(exclude_none=True))

    @app.post("/engines/scale_in", status_code=202, response_model=OperationInfo)
    async def scale_in(body: ScaleInRequest) -> dict:
        """Remove engines: each drains (no new requests, in-flight ones finish) up to the timeout, then
        is stopped (what is still in flight goes to the other engines)."""
        return await ask("submit", "scale_in", body.model_dump(exclude_none=True))

    @app.get("/operations", response_model=list[OperationInfo])
    async def operations() -> list:
        return await ask("operations")

    @app.get("/operations/{op_id}", response_model=OperationInfo)
    async def operation(op_id: str) -> dict:
        return await ask("operation", op_id)

    @app.post("/operations/{op_id}/cancel", response_model=OperationInfo)
    async def cancel(op_id: str) -> dict:
        """Cancel an operation the run has not started yet."""
        return await ask("cancel", op_id)

    return app


@serve.deployment(name="relax-control-api", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class ControlAPI:
    """Serve ingress; the FastAPI app is built in the replica (nothing is pickled but two strings)."""

    def __init__(self, hub_name: str, token: str | None) -> None:
        self.hub_name, self.token = hub_name, token

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.hub_name, self.token)
