"""Weight "sync" for a trainer-hosted engine (``rollout.host=trainer|driver``): publish the version only.

The engine decodes with the trainer's own module (``relax.core.engines.hosted``), so no bytes move;
what remains is the version handshake every transport has: the engine records which weights the
version names, answers with the version it now serves, and refuses to generate from weights that
changed afterwards. Chosen by the controller for hosted runs, not by ``weight_sync.transport``.
"""

from __future__ import annotations

import time
from typing import Any

from relax.core.lazy_ray import is_local
from relax.core.weight_sync.base import (
    WeightSyncError,
    check_versions,
    engine_names,
    is_actor,
    run_local,
    stats,
    wait_all,
)
from relax.core.weight_sync.transport import Transport


class HostedSync(Transport):
    """``sync(trainer, engines, version)``: every engine must be hosted by ``trainer`` (the trainer
    actor itself, or a local engine serving the local trainer's ``model``)."""

    name = "trainer_hosted"

    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        started = time.perf_counter()
        names = engine_names(engines)
        stray = [n for n, e in zip(names, engines, strict=True) if not _hosted_by(e, trainer)]
        if stray:
            raise WeightSyncError(
                f"rollout.host=trainer: {', '.join(stray)} not hosted by the trainer, so the trainer-hosted "
                "sync cannot reach it; use rollout.host=separate for engines in their own processes"
            )
        if is_actor(trainer) or is_local(trainer):
            pending = {names[0]: trainer.publish_version.remote(version).future()} if engines else {}
        else:
            pending = {n: run_local(_publish, e, version) for n, e in zip(names, engines, strict=True)}
        check_versions(wait_all(pending, self.timeout_s, f"publish version {version}"), version)
        return stats(time.perf_counter() - started, 0, 0, len(engines))


def _hosted_by(engine: Any, trainer: Any) -> bool:
    if is_local(trainer):  # both roles in the driver (rollout.host=driver): one object behind both handles
        return is_local(engine) and engine.local is trainer.local
    if is_actor(trainer):
        return is_actor(engine) and engine._actor_id == trainer._actor_id
    return not is_actor(engine) and getattr(engine, "model", None) is getattr(trainer, "model", object())


def _publish(engine: Any, version: int) -> int:
    engine.end_weight_update(version)
    return engine.weight_version()
