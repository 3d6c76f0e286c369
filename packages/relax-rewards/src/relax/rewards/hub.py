"""``hub``: one reward that routes each sample to registered rewards, isolated and time-bounded.

A sample's route is ``metadata[route_key]`` (e.g. ``data_source``), else ``default``. A route is a
weighted sum of components, each a registered reward with its own typed params. Components that
prefer process isolation (every pure reward here, and any plugin reward without
``isolation = "inline"``) run in the hub's process pool: a call past its ``timeout_s`` is killed with
its worker, a worker that dies (``os._exit``) is replaced. Inline components (``remote``, ``genrm``:
network-bound, holding sockets or actor handles) run on the hub's event loop, bounded the same way.
A failed component scores ``fallback_score``, is logged naming the sample, and is counted in the
sample's ``reward_info`` (``reward_failed`` / ``reward_timeout``, i.e. ``reward/failures`` and
``reward/timeouts``), so the run continues in every mode. Core's bound on one group call
(``reward.timeout_s``) is derived from these limits unless the config sets it
(:meth:`HubParams.group_timeout_s`).

``reward_info`` of a sample: ``score``; ``route/<route>`` (the route's mean per step); for each
component ``<name>/<key>`` of its components and ``<name>/failed`` (``<name>#<i>`` when a route
lists one reward twice); a single-component route also copies its keys unprefixed (``acc`` ...).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from relax.core.failures import add_failure
from relax.core.rewards.bounded import ScorerTimeout, as_result, bounded, call_scorer
from relax.core.rewards.runner import FAILED, TIMED_OUT

log = logging.getLogger(__name__)

HUB = "hub"
POOL_MARGIN_S = 10.0  # on top of a pooled call's timeout and worker start: the kill and the pipe


@dataclass(frozen=True)
class HubParams:
    """``reward.params`` of ``hub``.

    ``routes`` maps a route name to its components: a reward name (``math``), one component mapping
    (``{name: math, weight: 1.0, params: {...}, timeout_s: 10, isolate: true}``) or a list of them.
    """

    routes: dict[str, Any] = field(default_factory=dict)
    route_key: str = "data_source"  # metadata field that names a sample's route
    default: str | None = None  # route for samples whose field is missing or unknown; None: error
    workers: int = 2  # processes of the pool that runs isolated components
    max_concurrency: int = 8  # reward calls in flight at once (pool calls and inline calls)
    call_timeout_s: float = 30.0  # wall-clock limit per component call (a component may set timeout_s)
    fallback_score: float | None = (
        None  # score of a failed or timed-out component; None: reward.fallback_score
    )
    start_timeout_s: float = 120.0  # how long a call waits for a worker to start (imports included)

    def group_timeout_s(self, group_size: int) -> float:
        """Core's bound for one group call (``reward.timeout_s`` when the config leaves it out), so
        nobody lines up two timeouts by hand: every component call of the longest route for each
        sample, ``min(workers, max_concurrency)`` at a time, each within its timeout, plus one
        worker start and the kill margin. The hub then always reports its own per-component failures
        before core's bound would fail the whole group."""
        specs = [spec if isinstance(spec, list) else [spec] for spec in self.routes.values()] or [[]]
        timeouts = [
            item.get("timeout_s", self.call_timeout_s) if isinstance(item, dict) else self.call_timeout_s
            for items in specs
            for item in items
        ]
        longest = max([float(t) for t in timeouts if isinstance(t, int | float)] or [self.call_timeout_s])
        calls = max(group_size, 1) * max(len(items) for items in specs)
        waves = math.ceil(max(calls, 1) / max(min(self.workers, self.max_concurrency), 1))
        return waves * longest + self.start_timeout_s + POOL_MARGIN_S

    def validate(self) -> list[str]:
        errors = parse_routes(self)[1]
        for name, value, low in (("workers", self.workers, 1), ("max_concurrency", self.max_concurrency, 1)):
            if value < low:
                errors.append(f"{name}: must be >= {low}, got {value}")
        for name, value in (
            ("call_timeout_s", self.call_timeout_s),
            ("start_timeout_s", self.start_timeout_s),
        ):
            if not value > 0:
                errors.append(f"{name}: must be > 0, got {value}")
        if self.fallback_score is not None and not math.isfinite(self.fallback_score):
            errors.append(f"fallback_score: must be finite, got {self.fallback_score}")
        return errors


@dataclass(frozen=True)
class Component:
    key: str  # "<route>.<index>.<name>": names the pool target
    label: str  # prefix of its reward_info keys: the name, or "<name>#<index>" if the route repeats it
    name: str
    weight: float
    params: Any
    timeout_s: float
    isolate: bool | None


_COMPONENT_KEYS = {f.name for f in dataclasses.fields(Component)} - {"key", "label"}


def parse_routes(params: HubParams) -> tuple[dict[str, list[Component]], list[str]]:
    """Routes with typed component params, and every problem (paths relative to ``reward.params``)."""
    from relax.core.config import build_section
    from relax.core.plugins import UnknownNameError, get_plugin_manager

    manager = get_plugin_manager()
    routes: dict[str, list[Component]] = {}
    errors: list[str] = []
    if not params.routes:
        errors.append("routes: the hub needs at least one route, e.g. routes: {math: math}")
    for route, spec in params.routes.items():
        items = spec if isinstance(spec, list) else [spec]
        if not items:
            errors.append(f"routes.{route}: no components")
        comps = []
        names = [x if isinstance(x, str) else x.get("name") if isinstance(x, dict) else None for x in items]
        for i, item in enumerate(items):
            path = f"routes.{route}" + (f"[{i}]" if isinstance(spec, list) else "")
            item = {"name": item} if isinstance(item, str) else item
            if not isinstance(item, dict) or "name" not in item:
                errors.append(f"{path}: expected a reward name or a mapping with 'name', got {item!r}")
                continue
            unknown = sorted(set(item) - _COMPONENT_KEYS)
            if unknown:
                errors.append(
                    f"{path}: unknown keys {unknown}; allowed keys: {', '.join(sorted(_COMPONENT_KEYS))}"
                )
            name = item["name"]
            if name == HUB:
                errors.append(f"{path}.name: a hub cannot contain a hub")
                continue
            try:
                reg = manager.registration("reward", name)
            except UnknownNameError:
                errors.append(
                    f"{path}.name: unknown reward {name!r}; registered: {', '.join(manager.names('reward'))}"
                )
                continue
            typed = build_section(reg.config, item.get("params") or {}, f"{path}.params", errors)
            weight, timeout = item.get("weight", 1.0), item.get("timeout_s", params.call_timeout_s)
            if not (isinstance(weight, int | float) and math.isfinite(weight)):
                errors.append(f"{path}.weight: must be a finite number, got {weight!r}")
            if not (isinstance(timeout, int | float) and timeout > 0):
                errors.append(f"{path}.timeout_s: must be > 0, got {timeout!r}")
            isolate = item.get("isolate")
            if isolate not in (None, True, False):
                errors.append(f"{path}.isolate: must be true, false or null, got {isolate!r}")
            label = f"{name}#{i}" if names.count(name) > 1 else name
            weight = float(weight) if isinstance(weight, int | float) else 1.0
            timeout = float(timeout) if isinstance(timeout, int | float) else 1.0
            comps.append(Component(f"{route}.{i}.{name}", label, name, weight, typed, timeout, isolate))
        routes[route] = comps
    if params.default is not None and params.default not in params.routes:
        errors.append(
            f"default: {params.default!r} is not a route; routes: {', '.join(map(repr, params.routes)) or '(none)'}"
        )
    return routes, errors


def build_component(comp: Component, ctx: Any) -> Any:
    """The component's reward object: its registration's ``component`` builder (the bare reward,
    e.g. math without a pool of its own) or else its ordinary factory."""
    from relax.core.plugins import get_plugin_manager

    reg = get_plugin_manager().registration("reward", comp.name)
    return reg.options.get("component", reg.factory)(comp.params, ctx)


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "errors" or "timeouts"


class Hub:
    """Routes, combines, isolates. Build with ``Hub(params, ctx)`` (what ``reward.name: hub`` does)."""

    def __init__(self, params: HubParams, ctx: Any = None) -> None:
        from relax.rewards.pool import ProcessPool

        routes, errors = parse_routes(params)
        if errors:
            raise ValueError("invalid hub params:\n  " + "\n  ".join(errors))
        self.params, self.routes = params, routes
        own = params.fallback_score
        self.fallback_score = own if own is not None else getattr(ctx, "fallback_score", 0.0)
        self.rewards = {c.key: build_component(c, ctx) for comps in routes.values() for c in comps}
        self.pooled = {c.key for comps in routes.values() for c in comps if self._isolated(c)}
        self.pool = (
            ProcessPool(
                {k: self.rewards[k] for k in self.pooled},
                size=params.workers,
                start_timeout_s=params.start_timeout_s,
            )
            if self.pooled
            else None
        )
        self._sems: weakref.WeakKeyDictionary[Any, asyncio.Semaphore] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _isolated(self, comp: Component) -> bool:
        if comp.isolate is not None:
            return comp.isolate
        return getattr(self.rewards[comp.key], "isolation", "process") != "inline"

    def _sem(self) -> asyncio.Semaphore:
        """One semaphore per event loop (the conformance kit and core's runner use different loops)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if loop not in self._sems:
                self._sems[loop] = asyncio.Semaphore(self.params.max_concurrency)
            return self._sems[loop]

    def route_of(self, sample: Any) -> str:
        value = (sample.metadata or {}).get(self.params.route_key)
        if value is not None and str(value) in self.routes:
            return str(value)
        if self.params.default is not None:
            return self.params.default
        raise ValueError(
            f"no route for {self.params.route_key}={value!r} and no default; routes: {sorted(self.routes)}"
        )

    async def score(self, sample: Any) -> dict[str, float]:
        return (await self.score_group([sample]))[0]

    async def score_group(self, samples: list[Any]) -> list[dict[str, float]]:
        results: list[dict[str, Any]] = [{} for _ in samples]
        routes: list[str | None] = []
        for i, s in enumerate(samples):
            try:
                routes.append(self.route_of(s))
            except ValueError as e:
                routes.append(None)
                results[i]["__route__"] = _Failure("errors", str(e))
        calls = []
        for route, comps in self.routes.items():
            idx = [i for i, r in enumerate(routes) if r == route]
            for comp in comps if idx else ():
                calls.append(self._run(comp, [samples[i] for i in idx], idx, results))
        await asyncio.gather(*calls)
        return [self._combine(s, r, res) for s, r, res in zip(samples, routes, results, strict=True)]

    async def _run(
        self, comp: Component, samples: list[Any], idx: list[int], results: list[dict[str, Any]]
    ) -> None:
        """Score ``samples`` with one component; each result (or _Failure) lands in ``results``."""
        reward = self.rewards[comp.key]
        if comp.key not in self.pooled and callable(getattr(reward, "score_group", None)):
            values = await self._guard(comp, lambda: reward.score_group(samples), expect=len(samples))
            for i, v in zip(idx, values if isinstance(values, list) else [values] * len(idx), strict=True):
                results[i][comp.key] = v
            return

        async def one(i: int, s: Any) -> None:
            if comp.key in self.pooled:
                results[i][comp.key] = await self._guard(
                    comp, lambda: self.pool.acall(comp.key, s, comp.timeout_s)
                )
            else:
                results[i][comp.key] = await self._guard(comp, lambda: call_scorer(reward.score, s))

        await asyncio.gather(*(one(i, s) for i, s in zip(idx, samples, strict=True)))

    async def _guard(self, comp: Component, make_call: Any, expect: int | None = None) -> Any:
        """The call's value, or a _Failure: never raises. Inline calls are abandoned at ``timeout_s``;
        pool calls are killed there by the pool (plus a margin for the kill and the pipe)."""
        from relax.rewards.pool import CallTimeout

        async with self._sem():
            try:
                bound = comp.timeout_s + (
                    self.params.start_timeout_s + POOL_MARGIN_S if comp.key in self.pooled else 0
                )
                value = await bounded(make_call(), bound)
            except ScorerTimeout:
                return _Failure("timeouts", f"timed out after {comp.timeout_s:g}s")
            except CallTimeout as e:
                return _Failure(
                    "timeouts", f"timed out after {comp.timeout_s:g}s" + (f" ({e})" if str(e) else "")
                )
            except Exception as e:  # noqa: BLE001  # a component bug must not stop the run
                return _Failure("errors", f"{type(e).__name__}: {e}")
        if expect is not None and not (isinstance(value, list) and len(value) == expect):
            return _Failure("errors", f"score_group returned {value!r:.80} for {expect} samples")
        return value

    def _combine(self, sample: Any, route: str | None, res: dict[str, Any]) -> dict[str, float]:
        where = f"sample group {sample.group_id} index {sample.index_in_group}"
        if route is None:
            failure = res["__route__"]
            log.warning("reward hub: %s: %s (scored %g)", where, failure, self.fallback_score)
            add_failure(sample, "reward", f"reward hub: {failure} (scored {self.fallback_score:g})")
            return {"score": self.fallback_score, FAILED: 1.0}
        comps = self.routes[route]
        info: dict[str, float] = {}
        total, failed, timed_out = 0.0, False, False
        for comp in comps:
            value = res.get(comp.key)
            if isinstance(value, BaseException) and not isinstance(value, _Failure):
                value = _Failure("errors", f"{type(value).__name__}: {value}")  # one sample of a group call
            if not isinstance(value, _Failure):
                try:
                    parts = _as_parts(value)
                except (TypeError, ValueError) as e:
                    value = _Failure("errors", str(e))
            if isinstance(value, _Failure):
                log.warning(
                    "reward hub: %r (route %r) on %s: %s (scored %g)",
                    comp.name,
                    route,
                    where,
                    value,
                    self.fallback_score,
                )
                add_failure(
                    sample,
                    "reward",
                    f"reward hub: {comp.name!r} (route {route!r}): {value} (scored {self.fallback_score:g})",
                )  # console, failures.jsonl
                failed, timed_out = True, timed_out or value.kind == "timeouts"
                parts = {"score": self.fallback_score}
                info[f"{comp.label}/failed"] = 1.0
            else:
                info[f"{comp.label}/failed"] = 0.0
            total += comp.weight * parts["score"]
            info.update({f"{comp.label}/{k}": v for k, v in parts.items()})
            if len(comps) == 1:
                info.update({k: v for k, v in parts.items() if k != "score"})
        info.update({"score": total, f"route/{route}": total})
        if failed:
            info[FAILED] = 1.0
        if timed_out:
            info[TIMED_OUT] = 1.0
        return info

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        for reward in self.rewards.values():
            close = getattr(reward, "close", None)
            if callable(close):
                close()

    def __del__(self) -> None:
        pool = self.__dict__.get("pool")
        if pool is not None:
            pool.close()


def _as_parts(value: Any) -> dict[str, float]:
    """A component's result as ``{"score": .., ...}`` with finite floats only (else ValueError)."""
    _, info = as_result(value)
    bad = [k for k, v in info.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"returned non-finite values for {bad}")
    return info


def single(name: str, params: Any, ctx: Any = None, **hub: Any) -> Hub:
    """A one-route hub around one reward: how ``math`` and friends run alone, still isolated."""
    route = {
        "name": name,
        "params": dataclasses.asdict(params) if dataclasses.is_dataclass(params) else params,
    }
    return Hub(HubParams(routes={name: route}, default=name, **hub), ctx)
