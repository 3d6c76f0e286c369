"""Request and response bodies of the control API (Pydantic; unknown fields are errors)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SCALE = 64  # engines per request: a typo like 1000 must not reserve a cluster


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScaleOutRequest(Strict):
    """Either ``num_engines`` placed by Relax on the Ray cluster, or ``urls`` of running external
    engines to attach (for an engine backend that supports attaching)."""

    num_engines: int | None = Field(None, ge=1, le=MAX_SCALE)
    urls: list[str] | None = Field(None, min_length=1, max_length=MAX_SCALE)

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str] | None) -> list[str] | None:
        for url in urls or []:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http(s)://host[:port] URL")
            try:
                parts.port  # noqa: B018 -- raises on a bad port
            except ValueError as exc:
                raise ValueError(f"{url!r} has a bad port ({exc})") from None
        return urls

    @model_validator(mode="after")
    def _one_of(self) -> ScaleOutRequest:
        if (self.num_engines is None) == (self.urls is None):
            raise ValueError("give exactly one of num_engines or urls")
        return self


class ScaleInRequest(Strict):
    """Either ``num_engines`` (Relax picks the least loaded unprotected ones) or ``engine_ids``."""

    num_engines: int | None = Field(None, ge=1, le=MAX_SCALE)
    engine_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_SCALE)
    drain_timeout_s: float | None = Field(None, ge=0, le=3600)  # null: control.drain_timeout_s

    @field_validator("engine_ids")
    @classmethod
    def _non_negative(cls, ids: list[int] | None) -> list[int] | None:
        if ids and min(ids) < 0:
            raise ValueError(f"engine ids are >= 0, got {min(ids)}")
        return ids

    @model_validator(mode="after")
    def _one_of(self) -> ScaleInRequest:
        if (self.num_engines is None) == (self.engine_ids is None):
            raise ValueError("give exactly one of num_engines or engine_ids")
        return self


class EngineInfo(BaseModel):
    engine_id: int
    healthy: bool
    weight_version: int | None = None
    load: int = 0  # requests in flight
    draining: bool = False
    protected: bool = False
    node: str | None = None  # address of the Ray node it runs on
    error: str | None = None


class OperationInfo(BaseModel):
    id: str
    kind: str
    state: str  # pending, creating, health-checking, weight-syncing, draining, saving; active, done, failed, cancelled
    request: dict[str, Any]
    source: str
    created: float
    updated: float
    engine_ids: list[int] = []
    result: dict[str, Any] | None = None
    error: str | None = None
    history: list[str] = []


class QueueInfo(BaseModel):
    rows: float | None = None
    capacity: float | None = None
    depth: dict[str, float] = {}


class StatusResponse(BaseModel):
    name: str | None = None
    state: str  # starting, running, paused, finished
    mode: str | None = None
    step: int | None = None
    total_steps: int | None = None
    weight_version: int | None = None
    engines: list[EngineInfo] = []
    queue: QueueInfo = QueueInfo()
    trainer_idle_frac: float | None = None
    fleet: dict[str, Any] | None = None  # engines_live, engines_wanted, waiting, not_replaced, line
    operation: OperationInfo | None = None
    autoscaler: dict[str, Any] | None = None  # enabled, latest decisions (step, action, reason)
    status: str | None = None  # how the run ended (completed, failed, interrupted), once finished
    updated: float | None = None
