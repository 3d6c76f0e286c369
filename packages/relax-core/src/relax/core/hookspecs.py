"""Hook specifications: the contract between Relax and its plugins.

Hooks *register*; objects do the work (simonw/llm style). Every registration hook receives a
``register(name, factory, *, config=None, resources=None, in_driver=False, **options)`` callable (``options``: what one
kind reads, e.g. a rollout engine's ``attach=``); config then selects implementations by name. Core's
own built-ins are registered through these same hooks (``relax.core.builtin``).

- ``config``: a dataclass; the plugin's config section (``rollout.engine_params``,
  ``trainer.backend_params``, ``reward.params``, ``weight_sync.params``, ``data.processor_params``)
  is parsed into it by core's loader -- unknown keys, wrong types and bad enum values are errors
  naming the full dotted field, from ``relax validate`` too.
- ``resources``: ``resources(params) -> relax.core.context.Resources`` (CPUs, GPUs, worker
  processes) that the runtime reserves with Ray placement groups.
- ``in_driver``: the object may run inside the driver's own process instead of an actor of its own
  (read for rewards today, see ``relax_register_rewards``); core's built-ins declare it the same way.
- Factories are called ``factory(params, ctx)`` with the typed section and a
  :class:`relax.core.context.PluginContext` (model/tokenizer path, index/rank, world, run dir,
  timeouts) -- never the whole run config.

All registration hooks run once, in every process that builds the plugin manager (the driver and
each Ray worker that calls ``relax.core.plugins.get_plugin_manager()``). They must be cheap and
import heavy libraries lazily: a factory is only called when config selects it. Every ``relax_*``
function in a plugin module is treated as a hook implementation; a name that matches no spec here
is an error naming the plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import pluggy

hookspec = pluggy.HookspecMarker("relax")
hookimpl = pluggy.HookimplMarker("relax")

Register = Callable[..., None]


class RegisterPlugin(Protocol):
    """``register`` of the queue, rollout-engine, trainer, weight-sync, reward and processor hooks
    (each hook's docstring says which keywords its kind reads; ``options`` are kept on the
    registration, e.g. a rollout engine's ``attach=``)."""

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        config: type | None = None,
        resources: Callable[[Any], Any] | None = None,
        in_driver: bool = False,
        **options: Any,
    ) -> None: ...


class RegisterAlgorithm(Protocol):
    """``register`` of ``relax_register_algorithms``."""

    def __call__(
        self,
        name: str,
        fn: Callable[..., Any],
        kind: str,
        *,
        needs: Iterable[str] | None = None,
        modes: Iterable[str] | None = None,
    ) -> None: ...


class RegisterCommand(Protocol):
    """``register`` of ``relax_register_commands``."""

    def __call__(
        self,
        name: str,
        handler: Callable[[Any], int],
        *,
        help: str = "",
        arguments: Callable[[Any], None] | None = None,
    ) -> None: ...


class RegisterDataset(Protocol):
    """``register`` of ``relax_register_datasets`` (``relax.core.recipes.DatasetSpec`` holds the same fields)."""

    def __call__(
        self,
        name: str,
        convert: Callable[..., Any],
        /,
        *,
        hub_id: str,
        summary: str,
        reward: str,
        write_fixture: Callable[..., Any],
        read: Callable[..., Any] = ...,
        heldout_split: str | None = None,
        heldout_rows: int = 0,
    ) -> None: ...


class RegisterRecipe(Protocol):
    """``register`` of ``relax_register_recipes`` (``relax.core.recipes.Recipe`` holds the same fields)."""

    def __call__(
        self,
        name: str,
        template: Callable[[], str],
        /,
        *,
        dataset: str,
        model: str,
        hardware: str,
        example: str,
        smoke: str,
        modes: tuple[str, ...] = ...,
        mode_fields: dict[str, dict[str, Any]] = ...,
        model_config: Callable[[], str] | None = None,
    ) -> None: ...


@hookspec
def relax_register_queues(register: RegisterPlugin) -> None:
    """Register transfer-queue implementations (``queue.name`` selects one).

    When: plugin-manager construction, in the driver and in any worker that builds one.
    Parameters: ``register(name, factory)`` where ``factory(capacity=..., consumers=[...])`` returns a
    ``relax.core.protocols.TransferQueueLike`` (checked by ``relax.core.testing.QueueConformance``).
    Returns: nothing.

    .. versionadded:: 0.1
    """


@hookspec
def relax_register_rollout_engines(register: RegisterPlugin) -> None:
    """Register rollout engines (``rollout.engine`` selects one).

    When: plugin-manager construction. The factory runs inside each rollout Ray actor.
    Parameters: ``register(name, factory, config=ParamsDataclass, resources=fn, attach=None)`` where
    ``factory(params, ctx) -> RolloutEngine``; ``params`` is ``rollout.engine_params`` parsed into
    ``config``; ``ctx.index`` / ``ctx.world_size`` are the engine's index and the fleet size.
    ``attach="<field>"`` declares that the engine can serve from already running servers listed in
    ``rollout.engine_params.<field>`` (a list of URLs): the control plane's scale-out by URL then starts
    one engine per URL with that field set to ``[url]`` (``relax.core.plugins.attach_param``);
    without it a scale-out by URL is refused, naming the engine.
    Returns: nothing.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 factories take ``(params, ctx)``; ``config=`` and ``resources=``.
    """


@hookspec
def relax_register_trainers(register: RegisterPlugin) -> None:
    """Register trainer backends (``trainer.backend`` selects one).

    When: plugin-manager construction. The factory runs inside each trainer rank actor.
    Parameters: ``register(name, factory, config=ParamsDataclass, resources=fn)`` where
    ``factory(params, ctx) -> Trainer``; ``ctx.train`` (a ``TrainSpec``) carries core's optimisation
    settings and the algorithm, ``ctx.train.trainable`` is False for a frozen reference/teacher;
    ``ctx.index`` / ``ctx.world_size`` / ``ctx.master_addr`` / ``ctx.master_port`` describe the
    worker group when ``resources(params).num_workers > 1``.
    Returns: nothing.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 factories take ``(params, ctx)``; ``config=`` and ``resources=``.
    """


@hookspec
def relax_register_weight_syncs(register: RegisterPlugin) -> None:
    """Register weight-sync transports (``weight_sync.transport`` selects one).

    When: plugin-manager construction. The transport's sender runs in the trainer process and its
    receiver in each engine process; the driver only orchestrates.
    Parameters: ``register(name, factory, config=ParamsDataclass)`` where
    ``factory(params, ctx) -> WeightSync``; ``ctx.timeout_s`` / ``ctx.bucket_bytes`` come from
    ``weight_sync.timeout_s`` / ``weight_sync.bucket_mb``.
    Returns: nothing.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 factories take ``(params, ctx)``; ``config=``.
    """


@hookspec
def relax_register_rewards(register: RegisterPlugin) -> None:
    """Register reward functions (``reward.name`` selects one).

    When: plugin-manager construction. The factory runs inside the reward Ray actor, or in the
    driver's process when the reward declared ``in_driver=True``.
    Parameters: ``register(name, factory, config=ParamsDataclass, in_driver=False)`` where
    ``factory(params, ctx) -> Reward``; ``params`` is ``reward.params`` parsed into ``config``;
    ``ctx.engine_handle()`` gives a judge engine when the run has one. ``in_driver=True`` declares a
    cheap, self-contained reward (pure Python, no model, no blocking I/O) that may be scored in the
    driver: it then needs no actor, and the quick-start layout (``rollout.host: auto``) keeps every
    role in the driver with no Ray at all, exactly as for core's ``numeric`` and ``exact_match``.
    Undeclared rewards keep an actor of their own.
    Returns: nothing.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 factories take ``(params, ctx)``; ``config=``.
    .. versionchanged:: 0.3 ``in_driver=``.
    """


@hookspec
def relax_register_algorithms(register: RegisterAlgorithm) -> None:
    """Register algorithm pieces: advantage estimators, policy losses, KL estimators.

    When: plugin-manager construction, in every process that computes advantages or losses.
    Parameters: ``register(name, fn, kind=..., needs={...}, modes={...})`` with ``kind`` one of
    ``"advantage"``, ``"policy_loss"``, ``"kl"``. ``fn`` is a pure function on tensors (see
    ``relax.core.algorithms``). ``needs`` (default: nothing) says what it consumes, from
    ``relax.core.algorithm_needs.NEEDS`` (``values``, ``reference``, ``teacher``,
    ``greedy_baseline``, ``old_logprobs``, ``groups``, ...): the controller starts the roles these
    need and config validation derives its errors from them. ``modes`` (default: all) limits the
    execution modes it supports.
    Returns: nothing.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 ``needs=`` and ``modes=``.
    """


@hookspec
def relax_register_processors(register: RegisterPlugin) -> None:
    """Register prompt processors (``data.processor`` selects one; ``text`` is built in).

    When: plugin-manager construction. The factory runs in the driver, where the dataset turns rows
    into prompts.
    Parameters: ``register(name, factory, config=ParamsDataclass)`` where
    ``factory(params, ctx) -> Processor``; ``params`` is ``data.processor_params``;
    ``ctx.tokenizer_path`` / ``ctx.model_path`` locate the tokenizer and processor files.
    Returns: nothing.

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 called by the dataset; factories take ``(params, ctx)``.
    """


@hookspec
def relax_register_environments(register: RegisterPlugin) -> None:
    """Register multi-turn environments (``environment.name`` selects one; none = single-turn rollouts).

    When: plugin-manager construction. The factory runs in the driver, where rollouts are routed to
    the engines; its episodes step in worker threads there (a slow tool does not block the others).
    Parameters: ``register(name, factory, config=ParamsDataclass, tool_calls=False)`` where
    ``factory(params, ctx) -> Environment`` (``relax.core.protocols.Environment``); ``params`` is
    ``environment.params``; ``ctx.tokenizer_path`` locates the tokenizer. ``tool_calls=True``: the
    policy answers it with tool calls, so ``relax validate`` refuses ``environment.tool_parser: none``.
    Returns: nothing.

    .. versionadded:: 0.4
    """


@hookspec
def relax_register_tool_parsers(register: RegisterPlugin) -> None:
    """Register tool-call parsers (``environment.tool_parser`` selects one; ``none`` is built in).

    When: plugin-manager construction. The factory runs in the driver, once per run.
    Parameters: ``register(name, factory, config=ParamsDataclass)`` where
    ``factory(params, ctx) -> ToolParser`` (``relax.core.protocols.ToolParser``); ``params`` is
    ``environment.tool_parser_params``.
    Returns: nothing.

    .. versionadded:: 0.4
    """


@hookspec
def relax_register_inputs(register: RegisterPlugin) -> None:
    """Register generated inputs: a model and data a config can ask to be built on first use
    (``inputs.name`` selects one), as core builds the quick-start's when ``model.path`` / ``data.path``
    are null -- so an example runs from a fresh clone with no preparation command.

    When: when a config is loaded to run (``relax run``, ``relax.core.controller.run.run``), in the
    driver, before anything else starts; ``relax validate`` builds nothing (it says what a run builds).
    Parameters: ``register(name, factory, config=ParamsDataclass, fills=("model.path", "data.path"))``
    where ``factory(params, ctx) -> dict[str, str]`` builds what is missing (cached: a second call
    returns at once) and returns the config values it made, by dotted field; ``fills`` names them.
    Only fields the config leaves null are filled (a user's own path always wins); ``ctx.run_dir``.
    Returns: nothing.

    .. versionadded:: 0.4
    """


@hookspec
def relax_register_datasets(register: RegisterDataset) -> None:
    """Register published datasets that ``relax data prepare <name>`` converts into Relax rows.

    When: plugin-manager construction; read by ``relax data prepare``, ``relax init`` and a recipe's smoke
    inputs, in the CLI or driver process.
    Parameters: ``register(name, convert, hub_id=..., summary=..., reward=..., write_fixture=fn, read=fn,
    heldout_split=None, heldout_rows=0)`` where ``convert(source_row, output) -> (row, dedup_key)`` turns one
    published row (``relax.core.recipes.SourceRow``) into a Relax row, raising ``relax.core.recipes.RowError``
    for one it must skip (counted per reason); ``write_fixture(directory, rows)`` writes fixture rows in the
    published layout (``--smoke``, the tests); ``read(source, split, out_dir)`` yields the rows (default:
    Parquet / JSONL files or a Hub id); ``reward`` names the reward the rows are labelled for;
    ``heldout_split`` is the published split the recipes evaluate on, else ``heldout_rows`` are carved out.
    A dataset's CPU smoke inputs (``<name>-smoke``) are registered from ``relax_register_inputs`` with
    ``relax.core.recipes.register_smoke_inputs``.
    Returns: nothing.

    .. versionadded:: 0.5
    """


@hookspec
def relax_register_recipes(register: RegisterRecipe) -> None:
    """Register training recipes: a config that ``relax init --recipe <name>`` writes (``relax init --list``
    lists them with the package that provides them).

    When: plugin-manager construction; read by ``relax init``, ``relax data prepare`` and the memory plan.
    Parameters: ``register(name, template, dataset=..., model=..., hardware=..., example=..., smoke=...,
    modes=(...), mode_fields={mode: {dotted: value}}, model_config=fn)`` where ``template() -> str`` returns the
    commented YAML (``relax.core.recipes.packaged(package, path)`` reads a shipped file); ``dataset`` is a
    registered dataset's name; ``model`` the Hub id the config is sized for, on ``hardware`` (words such as
    ``"1 node x 8 GPUs (80 GB)"``); ``example`` / ``smoke`` its copy and its CPU variant in the repository;
    ``modes`` what ``relax init --mode`` may write, ``mode_fields`` what else changes with the mode;
    ``model_config() -> str`` the model's ``config.json``, so its memory plan works before the download.
    Returns: nothing.

    .. versionadded:: 0.5
    """


@hookspec
def relax_register_model_adapters(register: Register) -> None:
    """Register model adapters: how core loads and feeds one HF model family, keyed by its
    ``config.model_type`` (not selected in config: the checkpoint's type picks its adapter).

    When: plugin-manager construction, in every process that loads a model (the trainer ranks, the
    rollout engines, the driver when roles run there).
    Parameters: ``register(model_type, factory)`` where ``factory() -> ModelAdapter``
    (``relax.core.protocols.ModelAdapter``), called once per process on first use. A model type with
    no adapter loads with ``AutoModelForCausalLM`` (text only); media for it is an error naming the type.
    Returns: nothing.

    .. versionadded:: 0.3
    """


@hookspec
def relax_register_checkpoint_formats(register: Register) -> None:
    """Register trainer checkpoint formats that ``relax convert <checkpoint> <hf_dir>`` can turn into a
    plain HF model directory (a sharded backend's checkpoint is not one).

    When: when ``relax convert`` runs, in the CLI process (no Ray, no process group).
    Parameters: ``register(name, to_hf, detect=fn)`` where ``detect(path) -> bool`` says whether a
    trainer checkpoint directory is in this format and ``to_hf(path, hf_dir) -> int`` writes the HF
    directory and returns the number of tensors written. The first format that detects the directory
    converts it; none is an error listing the registered formats.
    Returns: nothing.

    .. versionadded:: 0.4
    """


@hookspec
def relax_register_commands(register: RegisterCommand) -> None:
    """Add ``relax <name>`` subcommands.

    When: when the ``relax`` CLI builds its argument parser, in the CLI process.
    Parameters: ``register(name, handler, help="...", arguments=fn)`` where
    ``arguments(parser)`` adds argparse arguments and ``handler(namespace) -> int`` runs the
    command and returns its exit code. A name that clashes with a built-in command is an error.
    Returns: nothing.

    .. versionadded:: 0.2
    """


@hookspec
def relax_on_run_start(run: Any) -> None:
    """Observe (and get control of) a run as it starts.

    When: in the driver, after every role is up and weights are synced, before the first step.
    Parameters: ``run`` -- a :class:`relax.core.controller.handle.RunHandle`: ``config`` (resolved),
    ``run_dir``, ``step``, ``metrics`` (latest step's), and ``control`` (``pause()``, ``resume()``,
    ``request_checkpoint()``, ``add_engine()``, ``remove_engine(index)``; applied between steps).
    Returns: ignored. Keep it quick; start a thread for long-running work. After an automatic
    trainer restart (``trainer.max_restarts``) the run starts again with a new handle, and this hook
    runs again (the previous attempt ended with ``relax_on_run_end(run, "failed")``).

    .. versionadded:: 0.2
    """


@hookspec
def relax_on_run_end(run: Any, status: str) -> None:
    """Observe the end of a run.

    When: in the driver, once, after the last step (or the failure) and before Ray shuts down.
    Parameters: ``run`` (the same handle as ``relax_on_run_start``), ``status`` -- ``"completed"``,
    ``"failed"`` or ``"interrupted"``.
    Returns: ignored.

    .. versionadded:: 0.2
    """


@hookspec
def relax_on_step_end(step: int, metrics: dict[str, float]) -> None:
    """Observe the end of a training step.

    When: in the driver, after the step's weights are synced and metrics logged.
    Parameters: ``step`` (1-based global step), ``metrics`` (flat ``name -> float`` dict; a copy).
    Returns: ignored.

    .. versionadded:: 0.1
    """


@hookspec
def relax_filter_group(group: list[Any]) -> bool | None:
    """Decide whether a group of samples (all responses to one prompt) is kept for training.

    When: in the driver, after rewards are computed and before advantages.
    Parameters: ``group`` -- list of ``Sample`` with rewards set.
    Returns: ``False`` to drop the group, ``True``/``None`` to keep it. Any ``False`` drops it.

    .. versionadded:: 0.1
    """
