"""``relax`` command line: run, validate, plugins, and subcommands that plugins register."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from relax.core.errors import ConfigError
from relax.core.plugins import PluginError


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[cfg.yaml] [a.b=c ...]`` -> (config path or None, overrides)."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    bad = [a for a in args if "=" not in a]
    if bad:
        raise ConfigError(f"expected overrides of the form key.path=value, got {bad}")
    return None, args


def _config_args(ns: argparse.Namespace) -> tuple[str | None, list[str]]:
    path, overrides = _split_args(ns.args)
    if getattr(ns, "address", None):
        overrides = [*overrides, f"ray.address={ns.address}"]
    return path, overrides


def _load(ns: argparse.Namespace, build_inputs: bool = True):
    """The validated config of ``relax run`` and ``relax validate`` alike: the loader's checks plus
    where the roles can live (``rollout.host``), so ``validate`` refuses exactly what ``run`` would.
    ``build_inputs=False`` (validate): an ``inputs`` plugin's model and data are not built."""
    from relax.core.config import config_error, load_config  # imports torch and the plugins: seconds
    from relax.core.recipes.commands import with_prepare_hint

    with (
        with_prepare_hint()
    ):  # a recipe's dataset not prepared yet: the error names the command that makes it
        cfg = load_config(
            *_config_args(ns), check_paths=True, build_inputs=build_inputs
        )  # before Ray: paths usable
    from relax.core.cluster import driver_paths

    cfg = driver_paths(cfg)  # the roles, on other nodes, do not share this process's current directory
    from relax.core.controller.hosting import placement_errors

    if errors := placement_errors(cfg):
        raise config_error(errors)
    from relax.core.memory_plan import gpu_memory, plan_errors

    gpu = getattr(ns, "gpu_memory", None)  # validate --gpu-memory, else cluster.gpu_memory_gb (0: no plan)
    if gpu_memory(cfg, gpu) and (errors := plan_errors(cfg, gpu)):
        raise config_error(errors)  # the plan does not fit (docs/memory-plan.md)
    return cfg


def _start_ray_early(argv: list[str]):
    """``relax run``: Ray starts first, while the plugins and the config import torch & co (see
    ``EarlyStart.before_config``); None for any other command or arguments it cannot read."""
    if not argv or argv[0] != "run" or {"-h", "--help"} & set(argv):
        return None
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("args", nargs="*")
    parser.add_argument("--address")
    try:
        path, overrides = _config_args(parser.parse_known_args(argv[1:])[0])
    except (argparse.ArgumentError, ConfigError):
        return None
    from relax.core.controller.startup import EarlyStart

    return EarlyStart.before_config(path, overrides)


def cmd_run(ns: argparse.Namespace) -> int:
    from relax.core.controller.startup import EarlyStart, process_start_time

    # main() already tried (ns.early, maybe None); a direct call starts Ray here
    early = ns.early if hasattr(ns, "early") else EarlyStart.before_config(*_config_args(ns))
    try:
        cfg = _load(ns)
    except (ConfigError, PluginError) as exc:
        print(f"relax: {exc}", file=sys.stderr, flush=True)  # at once: shutting Ray down takes a moment
        if early is not None:
            early.abandon()
        return 2
    except BaseException:
        if early is not None:
            early.abandon()
        raise
    try:
        from relax.core.controller.hosting import in_driver

        local = in_driver(cfg)
        if early is None:
            early = None if local else EarlyStart(cfg)  # every role in the driver: no Ray
        else:
            early.configure(cfg)  # the roles start while the driver imports the rest
        from relax.core.controller.run import run

        where = " (every role in this process: rollout.host=driver, no Ray)" if local else ""
        print(
            f"relax: running {cfg.name!r} in {cfg.mode} mode{where} for {cfg.total_steps} steps -> {cfg.run_dir}",
            flush=True,
        )
        summary = run(cfg, early=early, launched=process_start_time())
    except BaseException as exc:  # Ctrl-C too: one line and how to resume, the traceback to a file
        return _report_failure(exc, ns, cfg)
    last = summary.get("last_metrics", {})
    print(
        f"relax: done in {summary['seconds']:.0f}s; final reward mean {last.get('reward/mean', float('nan')):.3f}; "
        f"curves: {summary['run_dir']}/curves.png; model: {summary['final_hf']}",
        flush=True,
    )
    from relax.core.failures import format_summary

    for line in format_summary(summary.get("failures")):  # what failed, and why, below the threshold
        print(line, flush=True)
    return 0


def _report_failure(exc: BaseException, ns: argparse.Namespace, cfg) -> int:
    """Print why the run stopped and the command that resumes it; exit 130/143 for SIGINT/SIGTERM."""
    import shlex

    from relax.core.controller.recovery import reason, resume_point, write_error_log
    from relax.core.controller.signals import Interrupted

    if isinstance(exc, SystemExit):
        raise exc
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):  # Ray is down; a late Ctrl-C must not spew a traceback
        signal.signal(sig, signal.SIG_IGN)
    log_path = write_error_log(cfg.run_dir, exc)  # appended: an earlier failure's traceback stays
    step = getattr(exc, "relax_step", None)
    where = f" at step {step} of {cfg.total_steps}" if step is not None else ""
    detail = f" (traceback: {log_path})" if log_path else ""
    print(f"relax: stopped{where}: {reason(exc)}{detail}", file=sys.stderr, flush=True)
    checkpoint, resume = resume_point(cfg, getattr(exc, "relax_checkpoint", None))
    args = [*(a for a in ns.args if not a.startswith("checkpoint.resume=")), resume]
    command = shlex.join(
        ["relax", "run", *args, *(["--address", ns.address] if getattr(ns, "address", None) else [])]
    )
    if checkpoint:
        print(f"relax: resume from {checkpoint} with: {command}", file=sys.stderr, flush=True)
    else:
        print(
            f"relax: no checkpoint to resume from; start again with: {command}", file=sys.stderr, flush=True
        )
    if isinstance(exc, Interrupted):
        return 143 if exc.signame == "SIGTERM" else 130
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def cmd_validate(ns: argparse.Namespace) -> int:
    cfg = _load(ns, build_inputs=False)  # validation only: nothing is built, downloaded or started
    print(f"config OK: {cfg.name!r}, mode {cfg.mode}, {cfg.total_steps} steps")
    if cfg.inputs.name is not None:
        from relax.core.plugins import get_plugin_manager

        fills = get_plugin_manager().registration("inputs", cfg.inputs.name).options.get("fills", ())
        unset = [f for f in fills if _dotted(cfg, f) is None]
        if unset:
            print(
                f"note: inputs {cfg.inputs.name!r} builds {', '.join(unset)} on the first `relax run` "
                "(not built by validate; they are checked then)"
            )
    from relax.core.memory_plan import format_plan, gpu_memory, plan_for

    if gpu := gpu_memory(cfg, ns.gpu_memory):
        print(format_plan(plan_for(cfg, gpu), cfg.name))
    if ns.print:
        print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    """``relax plan``: the per-GPU memory table; exit 2 when it does not fit. Model paths need not exist yet
    (the recipes' models have shipped shapes); everything else is checked as ``relax validate`` does."""
    from relax.core.config import load_config
    from relax.core.memory_plan import ShapeError, format_plan, gpu_memory, plan_for

    cfg = load_config(*_config_args(ns))
    gpu = gpu_memory(cfg, ns.gpu_memory)
    if not gpu:
        raise ConfigError(
            "relax plan: how much memory has each GPU? pass --gpu-memory GIB, or set cluster.gpu_memory_gb"
        )
    try:
        plan = plan_for(cfg, gpu)
    except ShapeError as exc:
        raise ConfigError(f"memory plan: {exc}") from None
    print(format_plan(plan, cfg.name))
    return 2 if plan.errors() else 0


def _dotted(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def cmd_plugins(ns: argparse.Namespace) -> int:
    from relax.core.plugins import format_plugins, get_plugin_manager

    print(format_plugins(get_plugin_manager()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relax", description="Relax: asynchronous RL post-training engine")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train; with no config runs the bundled CPU quick-start")
    run.add_argument("args", nargs="*", help="[config.yaml] [key.path=value ...]")
    run.add_argument("--address", help="join an existing Ray cluster instead of starting one")
    run.set_defaults(fn=cmd_run)
    validate = sub.add_parser("validate", help="validate a config (and overrides) without running")
    validate.add_argument("args", nargs="*", help="[config.yaml] [key.path=value ...]")
    validate.add_argument("--print", action="store_true", help="print the resolved config as JSON")
    validate.add_argument("--gpu-memory", type=float, help="GiB per GPU: check the memory plan against it")
    validate.set_defaults(fn=cmd_validate)
    plan = sub.add_parser("plan", help="per-GPU memory plan of a config: every term, and whether it fits")
    plan.add_argument("args", nargs="*", help="[config.yaml] [key.path=value ...]")
    plan.add_argument("--gpu-memory", type=float, help="GiB per GPU (default: cluster.gpu_memory_gb)")
    plan.set_defaults(fn=cmd_plan)
    plugins = sub.add_parser("plugins", help="list installed plugins and what each registered")
    plugins.set_defaults(fn=cmd_plugins)
    from relax.core.convert import add_arguments, cmd_convert

    convert = sub.add_parser(
        "convert", help="write a trainer checkpoint (fsdp, megatron, ...) as an HF model directory"
    )
    add_arguments(convert)
    convert.set_defaults(fn=cmd_convert)
    from relax.core.eval_command import add_arguments as add_eval_arguments
    from relax.core.eval_command import cmd_eval

    evaluate = sub.add_parser(
        "eval", help="evaluate a model, run or checkpoint on the config's eval sets (no training)"
    )
    add_eval_arguments(evaluate)
    evaluate.set_defaults(fn=cmd_eval)
    from relax.core.inspect_command import add_arguments as add_inspect_arguments
    from relax.core.inspect_command import cmd_inspect

    inspect = sub.add_parser(
        "inspect", help="print logged trajectories: turns, tool calls, trained and masked tokens"
    )
    add_inspect_arguments(inspect)
    inspect.set_defaults(fn=cmd_inspect)
    from relax.core.recipes.commands import add_recipe_commands

    add_recipe_commands(sub)  # relax data prepare, relax init
    _add_plugin_commands(sub)
    return parser


def _add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    """``relax <name>`` for every command registered through ``relax_register_commands``."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    for name in manager.names("command"):
        reg = manager.registration("command", name)
        if name in sub.choices:
            raise PluginError(
                f"plugin {reg.plugin!r} registered command {name!r}, which is a built-in relax command"
            )
        parser = sub.add_parser(name, help=reg.options.get("help", f"(from plugin {reg.plugin})"))
        if (arguments := reg.options.get("arguments")) is not None:
            arguments(parser)
        parser.set_defaults(fn=reg.factory)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    early = _start_ray_early(argv)
    try:
        ns = build_parser().parse_args(argv)
        ns.early, early = early, None  # cmd_run owns it now
        return int(ns.fn(ns) or 0)
    except (ConfigError, PluginError) as exc:
        print(f"relax: {exc}", file=sys.stderr)
        return 2
    finally:
        if early is not None:  # the arguments or a plugin failed before the run took over
            early.abandon()


if __name__ == "__main__":
    sys.exit(main())
