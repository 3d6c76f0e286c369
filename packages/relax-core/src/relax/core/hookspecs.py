"""Hook specifications: the contract between Relax and its plugins.

Hooks *register*; objects do the work (simonw/llm style). Every registration hook receives a
``register(name, factory, **kw)`` callable; config then selects implementations by name.
Core's own built-ins are registered through these same hooks (``relax.core.builtin``).

All registration hooks run once, in the driver process (``relax run`` / ``relax plugins``),
when the plugin manager is first built, and again inside any Ray worker that calls
``relax.core.plugins.get_plugin_manager()``. They must be cheap and import heavy libraries lazily:
a factory is only called when config selects it.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("relax")
hookimpl = pluggy.HookimplMarker("relax")


@hookspec
def relax_register_queues(register):
    """Register transfer-queue implementations.

    When: plugin-manager construction, in the driver and in any worker that builds one.
    Parameters: ``register(name, factory)`` where ``factory(capacity=..., **kw) -> TransferQueue``.
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_register_rollout_engines(register):
    """Register rollout engines (``rollout.engine`` selects one).

    When: plugin-manager construction. The factory runs inside the rollout Ray actor.
    Parameters: ``register(name, factory)`` where ``factory(cfg, model_path) -> RolloutEngine``
    (``cfg`` is the whole ``RelaxConfig``; engine-specific settings live in ``rollout.engine_params``).
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_register_trainers(register):
    """Register trainer backends (``trainer.backend`` selects one).

    When: plugin-manager construction. The factory runs inside the trainer Ray actor.
    Parameters: ``register(name, factory)`` where ``factory(cfg, model_path, reference=False) -> Trainer``
    (``reference=True`` asks for a frozen model that only serves ``forward_logprobs``).
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_register_weight_syncs(register):
    """Register weight-sync transports (``weight_sync.transport`` selects one).

    When: plugin-manager construction, in the driver.
    Parameters: ``register(name, factory)`` where ``factory(timeout_s=..., bucket_bytes=...) -> WeightSync``.
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_register_rewards(register):
    """Register reward functions (``reward.name`` selects one).

    When: plugin-manager construction. The factory runs inside the reward Ray actor.
    Parameters: ``register(name, factory)`` where ``factory(**reward.params) -> Reward``.
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_register_algorithms(register):
    """Register algorithm pieces: advantage estimators, policy losses, KL estimators.

    When: plugin-manager construction, in every process that computes advantages or losses.
    Parameters: ``register(name, fn, kind=...)`` with ``kind`` one of ``"advantage"``,
    ``"policy_loss"``, ``"kl"``. ``fn`` is a pure function on tensors (see ``relax.core.algorithms``).
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_register_processors(register):
    """Register multimodal processors (``data.processor`` selects one).

    When: plugin-manager construction, in rollout and trainer processes.
    Parameters: ``register(name, factory)`` where ``factory(cfg) -> Processor``.
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_on_step_end(step: int, metrics: dict[str, Any]):
    """Observe the end of a training step.

    When: in the driver, after the step's weights are synced and metrics logged.
    Parameters: ``step`` (1-based global step), ``metrics`` (flat ``name -> float`` dict; read-only).
    Returns: ignored.

    .. versionadded:: 0.1
    """


@hookspec
def relax_filter_group(group: list[Any]) -> bool | None:
    """Decide whether a group of samples (all responses to one prompt) is kept for training.

    When: in the driver, after rewards are computed and before advantages.
    Parameters: ``group`` — list of ``Sample`` with rewards set.
    Returns: ``False`` to drop the group, ``True``/``None`` to keep it. Any ``False`` drops it.

    .. versionadded:: 0.1
    """
