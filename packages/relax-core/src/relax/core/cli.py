"""``relax`` command line: run, validate, plugins, and subcommands that plugins register."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from relax.core.config import ConfigError, load_config
from relax.core.plugins import PluginError


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[cfg.yaml] [a.b=c ...]`` -> (config path or None, overrides)."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    bad = [a for a in args if "=" not in a]
    if bad:
        raise ConfigError(f"expected overrides of the form key.path=value, got {bad}")
    return None, args


def _load(ns: argparse.Namespace):
    path, overrides = _split_args(ns.args)
    if getattr(ns, "address", None):
        overrides = [*overrides, f"ray.address={ns.address}"]
    return load_config(path, overrides, check_paths=True)  # before Ray: data, model and run_dir usable


def cmd_run(ns: argparse.Namespace) -> int:
    cfg = _load(ns)
    from relax.core.controller.run import run

    print(f"relax: running {cfg.name!r} in {cfg.mode} mode for {cfg.total_steps} steps -> {cfg.run_dir}", flush=True)
    summary = run(cfg)
    last = summary.get("last_metrics", {})
    print(
        f"relax: done in {summary['seconds']:.0f}s; final reward mean {last.get('reward/mean', float('nan')):.3f}; "
        f"curves: {summary['run_dir']}/curves.png; model: {summary['final_hf']}",
        flush=True,
    )
    return 0


def cmd_validate(ns: argparse.Namespace) -> int:
    cfg = _load(ns)
    print(f"config OK: {cfg.name!r}, mode {cfg.mode}, {cfg.total_steps} steps")
    if ns.print:
        print(json.dumps(cfg.to_dict(), indent=2))
    return 0


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
    validate.set_defaults(fn=cmd_validate)
    plugins = sub.add_parser("plugins", help="list installed plugins and what each registered")
    plugins.set_defaults(fn=cmd_plugins)
    _add_plugin_commands(sub)
    return parser


def _add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    """``relax <name>`` for every command registered through ``relax_register_commands``."""
    from relax.core.plugins import get_plugin_manager

    manager = get_plugin_manager()
    for name in manager.names("command"):
        reg = manager.registration("command", name)
        if name in sub.choices:
            raise PluginError(f"plugin {reg.plugin!r} registered command {name!r}, which is a built-in relax command")
        parser = sub.add_parser(name, help=reg.options.get("help", f"(from plugin {reg.plugin})"))
        if (arguments := reg.options.get("arguments")) is not None:
            arguments(parser)
        parser.set_defaults(fn=reg.factory)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        ns = build_parser().parse_args(argv)
        return int(ns.fn(ns) or 0)
    except (ConfigError, PluginError) as exc:
        print(f"relax: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
