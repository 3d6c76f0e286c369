"""What a plugin factory receives besides its own typed config section.

Every factory is called ``factory(params, ctx)``: ``params`` is the plugin's parsed config section
(``rollout.engine_params``, ``trainer.backend_params``, ``reward.params``, ``weight_sync.params``,
``data.processor_params``) and ``ctx`` is a :class:`PluginContext` -- a deliberately small view of
the run (paths, rank, world, timeouts), never the whole ``RelaxConfig``, so a plugin cannot grow
hidden dependencies on unrelated settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Resources:
    """What one instance of a backend needs: per engine, or for the whole trainer.

    ``num_workers`` > 1 makes the trainer a worker group of that many rank actors, each given
    ``num_cpus`` / ``num_gpus``.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    num_workers: int = 1


@dataclass(frozen=True)
class TrainSpec:
    """Core's optimisation settings for a trainer backend. The backend takes them as one typed object,
    ``relax.core.policy_update.UpdateSettings.from_context(ctx)``, and builds its loss with
    ``relax.core.algorithms.build_policy_objective(algorithm)`` -- it never branches on algorithm
    names (prime-rl style)."""

    optim: Any  # relax.core.config.TrainerConfig
    algorithm: Any  # relax.core.algorithms.config.AlgorithmConfig
    total_steps: int
    temperature: float = 1.0  # rollout temperature: logits are divided by it, as the engine does
    trainable: bool = True  # False: a frozen reference / teacher that only serves forward_logprobs


@dataclass(frozen=True)
class PluginContext:
    """The run as a plugin sees it.

    ``role`` is one of ``rollout``, ``trainer``, ``reference``, ``teacher``, ``reward``,
    ``weight_sync``, ``processor``. ``index`` / ``world_size`` are the engine index and fleet size
    for engines, the rank and number of ranks for trainer workers. ``master_addr`` /
    ``master_port`` are set for trainer worker groups (the rendezvous for their process group).
    """

    role: str
    run_dir: str = "."
    seed: int = 0
    model_path: str | None = None
    tokenizer_path: str | None = None
    dtype: str = "float32"
    index: int = 0
    world_size: int = 1
    timeout_s: float = 120.0
    bucket_bytes: int = 64 << 20
    master_addr: str | None = None
    master_port: int | None = None
    train: TrainSpec | None = None
    #: rewards: returns a Ray handle to a rollout engine (e.g. a GenRM judge), or None if the run has none
    engine_handle: Callable[[], Any] | None = None
    #: rewards: ``reward.fallback_score``, the score core gives a sample whose reward failed
    fallback_score: float = 0.0
    #: rollout engines: return each token's MoE routing with the result (``algorithm.routing_replay`` is not off)
    record_routing: bool = False
    #: rollout engines: the run's ``trainer.lora`` (weight syncs then carry adapters only; an engine that must be
    #: launched for them, like ``sglang``, reads rank and target modules here)
    lora: Any = None
    resources: Resources = Resources()
