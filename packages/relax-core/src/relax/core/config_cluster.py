"""The ``cluster`` section: the GPUs a run is sized for, which the memory plan checks it against
(``relax.core.memory_plan``; docs/memory-plan.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClusterConfig:
    # GPUs the run is written for (all nodes); 0: not stated. relax validate refuses a run reserving more
    gpus: int = 0
    # memory of each GPU in GiB, as sold (80 for an H100 80GB, 141 for an H200); 0: no memory plan check.
    # Set: relax validate / run refuse a run whose plan does not fit, naming the term that overflows
    gpu_memory_gb: float = 0.0


def cluster_errors(cfg: Any) -> list[str]:
    c = cfg.cluster
    errors = [f"cluster.gpus: must be >= 0, got {c.gpus}"] if c.gpus < 0 else []
    if c.gpu_memory_gb < 0:
        errors.append(f"cluster.gpu_memory_gb: must be >= 0 (0: no memory plan), got {c.gpu_memory_gb}")
    return errors
