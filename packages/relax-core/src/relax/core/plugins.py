"""Plugin manager over the ``relax`` entry-point group, and the name registries it fills.

Core's built-ins (``relax.core.builtin``) are an ordinary entry point, so they are loaded,
listed and disabled exactly like third-party plugins. ``RELAX_DISABLE_PLUGINS`` is a comma list of
entry-point names to skip (``core`` included, for tests that want a bare registry).
``RELAX_PLUGINS`` is a comma list of importable modules to load as plugins without packaging them
(like ``PYTEST_PLUGINS``); Ray workers inherit it, so roles see the same registry as the driver.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from relax.core import hookspecs
from relax.core.algorithm_needs import declared

ENTRY_POINT_GROUP = "relax"

#: registry kind -> registration hook name
REGISTRATION_HOOKS = {
    "queue": "relax_register_queues",
    "rollout_engine": "relax_register_rollout_engines",
    "trainer": "relax_register_trainers",
    "weight_sync": "relax_register_weight_syncs",
    "reward": "relax_register_rewards",
    "advantage": "relax_register_algorithms",
    "policy_loss": "relax_register_algorithms",
    "kl": "relax_register_algorithms",
    "processor": "relax_register_processors",
    "command": "relax_register_commands",
    "model_adapter": "relax_register_model_adapters",
    "checkpoint_format": "relax_register_checkpoint_formats",
    "environment": "relax_register_environments",
    "tool_parser": "relax_register_tool_parsers",
    "inputs": "relax_register_inputs",
    "dataset": "relax_register_datasets",
    "recipe": "relax_register_recipes",
}
ALGORITHM_KINDS = ("advantage", "policy_loss", "kl")


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered something invalid."""


class UnknownNameError(KeyError):
    """Config asked for a name nobody registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


@dataclass(frozen=True)
class Registration:
    """One registered name. ``config`` is the dataclass the plugin's config section is parsed into
    (None: the section stays a dict); ``resources(params) -> Resources`` says what one instance
    needs; ``in_driver``: the object may run inside the driver's own process (cheap, no Ray actor
    needed: core's rule rewards declare it like any plugin's); ``options`` keeps kind-specific
    keywords (e.g. a command's ``help``)."""

    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    config: type | None = None
    resources: Callable[[Any], Any] | None = None
    in_driver: bool = False
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    registered: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)


class Registry:
    """Name -> factory tables, one per kind; duplicate names are errors naming both plugins."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Registration]] = {kind: {} for kind in REGISTRATION_HOOKS}

    def add(self, kind: str, name: str, factory: Callable[..., Any], plugin: str, **extra: Any) -> None:
        if kind not in self._entries:
            raise PluginError(
                f"plugin {plugin!r} registered unknown kind {kind!r}; kinds: {sorted(self._entries)}"
            )
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {kind} with invalid name {name!r}")
        if not callable(factory):
            raise PluginError(f"plugin {plugin!r} registered {kind} {name!r} with a non-callable {factory!r}")
        existing = self._entries[kind].get(name)
        if existing is not None:
            raise PluginError(
                f"duplicate {kind} name {name!r}: registered by plugin {existing.plugin!r} and by plugin {plugin!r}"
            )
        config = extra.get("config")
        if config is not None and not dataclasses.is_dataclass(config):
            raise PluginError(
                f"plugin {plugin!r}: {kind} {name!r} config= must be a dataclass, got {config!r}"
            )
        if not isinstance(extra.get("in_driver", False), bool):
            raise PluginError(
                f"plugin {plugin!r}: {kind} {name!r} in_driver= must be True or False, "
                f"got {extra['in_driver']!r}"
            )
        self._entries[kind][name] = Registration(kind, name, factory, plugin, **extra)

    def get(self, kind: str, name: str) -> Callable[..., Any]:
        return self.registration(kind, name).factory

    def registration(self, kind: str, name: str) -> Registration:
        try:
            return self._entries[kind][name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {kind} {name!r}; registered {kind} names: {self.names(kind)}"
            ) from None

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self) -> list[Registration]:
        return [reg for table in self._entries.values() for reg in table.values()]


def _disabled() -> set[str]:
    return {p.strip() for p in os.environ.get("RELAX_DISABLE_PLUGINS", "").split(",") if p.strip()}


class _HookManager(pluggy.PluginManager):
    """Treats every ``relax_*`` function of a plugin as a hook implementation, marked or not (as pytest
    does with ``pytest_*``), so that ``check_pending`` turns a misspelt hook name into an error."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("relax_") and inspect.isroutine(getattr(plugin, name, None)):
            opts = {}
        return opts


class RelaxPluginManager:
    """pluggy manager + registries. Build with :func:`get_plugin_manager`."""

    def __init__(self, extra_plugins: dict[str, Any] | None = None, load_entry_points: bool = True) -> None:
        self.pm = _HookManager("relax")
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.registry = Registry()
        if load_entry_points:
            self._load_entry_points()
            self._load_env_modules()
        for name, module in (extra_plugins or {}).items():
            self._add(name, module, PluginInfo(name, "(in-process)", "-"))
        self._run_registrations()

    def _load_entry_points(self) -> None:
        disabled = _disabled()
        seen: set[str] = set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in disabled or ep.name in seen:
                continue
            seen.add(ep.name)
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must say who it is
                raise PluginError(f"failed to load relax plugin {ep.name!r} ({ep.value}): {exc}") from exc
            dist = ep.dist
            info = PluginInfo(ep.name, dist.name if dist else "?", dist.version if dist else "?")
            self._add(ep.name, module, info)

    def _load_env_modules(self) -> None:
        for module_name in [m.strip() for m in os.environ.get("RELAX_PLUGINS", "").split(",") if m.strip()]:
            if module_name in self.infos or module_name in _disabled():
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                raise PluginError(
                    f"RELAX_PLUGINS: cannot import plugin module {module_name!r}: {exc}"
                ) from exc
            self._add(module_name, module, PluginInfo(module_name, "(RELAX_PLUGINS)", "-"))

    def _add(self, name: str, module: Any, info: PluginInfo) -> None:
        if self.pm.is_registered(module):  # an installed entry point and RELAX_PLUGINS (or two entry points)
            first = self.pm.get_name(module)
            raise PluginError(
                f"plugin module {getattr(module, '__name__', module)!r} is loaded twice: as plugin {first!r} "
                f"({_source(self.infos.get(first))}) and as plugin {name!r} ({_source(info)}); keep one of them "
                f"(drop it from RELAX_PLUGINS, or disable one with RELAX_DISABLE_PLUGINS={name})"
            )
        try:
            self.pm.register(module, name=name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=name)
            known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("relax_")))
            raise PluginError(f"plugin {name!r}: {exc}; known hooks: {known}") from exc
        self.infos[name] = info

    def _run_registrations(self) -> None:
        """Each registration hook runs through ``pm.hook``, one plugin at a time so that every
        registration is attributed to the plugin that made it."""
        hooks = sorted(set(REGISTRATION_HOOKS.values()))
        plugins = dict(self.pm.list_name_plugin())
        for plugin_name in plugins:
            others = [m for n, m in plugins.items() if n != plugin_name]
            for hook_name in hooks:
                caller = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
                try:
                    caller(register=self._register_fn(hook_name, plugin_name))
                except PluginError:
                    raise
                except Exception as exc:  # a broken plugin must say who it is
                    raise PluginError(
                        f"plugin {plugin_name!r}: {hook_name} raised {type(exc).__name__}: {exc}"
                    ) from exc

    def _register_fn(self, hook_name: str, plugin: str) -> Callable[..., None]:
        default_kind = next(k for k, h in REGISTRATION_HOOKS.items() if h == hook_name)
        is_algorithm = hook_name == "relax_register_algorithms"

        def register(
            name: str,
            factory: Callable[..., Any],
            kind: str | None = None,
            *,
            config: type | None = None,
            resources: Callable[[Any], Any] | None = None,
            in_driver: bool = False,
            **options: Any,
        ) -> None:
            if is_algorithm and kind not in ALGORITHM_KINDS:
                raise PluginError(
                    f"plugin {plugin!r}: relax_register_algorithms needs kind= one of {list(ALGORITHM_KINDS)}, got {kind!r}"
                )
            if not is_algorithm and kind not in (None, default_kind):
                raise PluginError(f"plugin {plugin!r}: {hook_name} registers {default_kind!r}, not {kind!r}")
            resolved = kind or default_kind
            if is_algorithm:  # what it consumes and where it runs: roles and validation derive from these
                try:
                    options["needs"], options["modes"] = declared(
                        resolved, name, options.get("needs"), options.get("modes")
                    )
                except ValueError as exc:
                    raise PluginError(f"plugin {plugin!r}: {exc}") from None
            self.registry.add(
                resolved,
                name,
                factory,
                plugin,
                config=config,
                resources=resources,
                in_driver=in_driver,
                options=options,
            )
            self.infos[plugin].registered.append((resolved, name))

        return register

    @property
    def hook(self):
        return self.pm.hook

    def get(self, kind: str, name: str) -> Callable[..., Any]:
        return self.registry.get(kind, name)

    def names(self, kind: str) -> list[str]:
        return self.registry.names(kind)

    def registration(self, kind: str, name: str) -> Registration:
        return self.registry.registration(kind, name)


_MANAGER: RelaxPluginManager | None = None


def get_plugin_manager(refresh: bool = False) -> RelaxPluginManager:
    """Process-wide plugin manager (entry points are scanned once per process)."""
    global _MANAGER
    if _MANAGER is None or refresh:
        _MANAGER = RelaxPluginManager()
    return _MANAGER


def attach_param(engine: str, manager: RelaxPluginManager | None = None) -> str | None:
    """The ``rollout.engine_params`` field (a list of URLs) through which rollout engine ``engine``
    attaches to running servers, as declared at registration (``attach=...``); None: it cannot attach."""
    manager = manager or get_plugin_manager()
    return manager.registration("rollout_engine", engine).options.get("attach")


def _source(info: PluginInfo | None) -> str:
    if info is None:
        return "?"
    if info.distribution == "(RELAX_PLUGINS)":
        return "RELAX_PLUGINS"
    return f"entry point of distribution {info.distribution} {info.version}"


def lifecycle_hooks(manager: RelaxPluginManager, plugin_name: str) -> list[str]:
    """The hooks other than registration ones (``relax_on_step_end``, ``relax_filter_group``, ...) a plugin implements."""
    plugin = manager.pm.get_plugin(plugin_name)
    callers = manager.pm.get_hookcallers(plugin) or [] if plugin is not None else []
    registration = set(REGISTRATION_HOOKS.values())
    return sorted(c.name for c in callers if c.name not in registration)


def format_plugins(manager: RelaxPluginManager) -> str:
    """Human-readable listing for ``relax plugins``: what each plugin registered, and the hooks it runs."""
    lines = []
    for info in manager.infos.values():
        lines.append(f"{info.name} ({info.distribution} {info.version})")
        by_kind: dict[str, list[str]] = {}
        for kind, name in info.registered:
            by_kind.setdefault(kind, []).append(name)
        for kind in sorted(by_kind):
            lines.append(f"  {kind}: {', '.join(sorted(by_kind[kind]))}")
        if hooks := lifecycle_hooks(manager, info.name):
            lines.append(f"  hooks: {', '.join(hooks)}")
    return "\n".join(lines)
