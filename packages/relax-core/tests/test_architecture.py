"""The import graph of every package's source: no circle, no upward import, no cross-package private.

Built from the source with ``ast`` (nothing is imported), over the PEP 420 ``relax`` namespace
spread across ``packages/*/src``, so ``relax.rewards -> relax.core`` is an arrow like any other.
Every import counts, also the lazy ones inside functions (a lazy import hides a circle from Python,
not from the reader); only ``if TYPE_CHECKING:`` blocks are left out (annotations, never executed).

- a *file* imports only files below it: the file graph has no cycle;
- a *room* imports only rooms below it: a room is a direct subpackage of ``relax.core``
  (``controller``, ``weight_sync``, ...) or one of its top-level modules (``plugins.py``), and each
  other distribution (``relax.megatron``, ...) is one room; the room graph has no cycle either;
- no module imports an underscore name of another distribution (``from relax.core.x import _y``,
  ``relax.core.x._y``): what a package takes from another is that package's public API.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]


@dataclass
class Module:
    name: str
    path: Path
    distribution: str
    is_package: bool
    imports: set[str] = field(default_factory=set)  # relax.* modules this one imports
    privates: list[str] = field(default_factory=list)  # "line: what" for cross-distribution private names


def discover(packages: Path = PACKAGES) -> dict[str, Module]:
    """Every ``relax.*`` module under ``packages/*/src``, by dotted name."""
    modules = {}
    for src in sorted(packages.glob("*/src")):
        for path in sorted((src / "relax").rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join(parts)
            modules[name] = Module(name, path, src.parent.name, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (their ``else`` still runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _owner(name: str, modules: dict[str, Module]) -> str | None:
    """The longest known module that ``name`` is, or sits in (``a.b.c`` -> ``a.b`` if only that exists)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _base(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _where(module: Module) -> str:
    """``relax-rewards/src/relax/rewards/hub.py``: the file, from its distribution's folder."""
    depth = len(module.name.split(".")) + module.is_package  # folders between the file and src/
    return str(module.path.relative_to(module.path.parents[depth + 1]))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def scan(modules: dict[str, Module]) -> dict[str, Module]:
    """Fill each module's ``imports`` and cross-distribution ``privates``."""
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        bound: dict[str, str] = {}  # local name -> relax module it is bound to (for ``alias._name``)

        def arrow(target: str | None, line: int, what: str, _module: Module = module) -> None:
            if target is None or target == _module.name:
                return
            _module.imports.add(target)
            foreign = modules[target].distribution != _module.distribution
            if foreign and any(_private(part) for part in what.split(".")):
                _module.privates.append(f"{_where(_module)}:{line}: {what}")

        nodes = list(_runtime_nodes(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if not alias.name.startswith("relax."):
                        continue
                    target = _owner(alias.name, modules)
                    arrow(target, node.lineno, alias.name)
                    if alias.asname and target == alias.name:
                        bound[alias.asname] = target
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, node)
                if base != "relax" and not base.startswith("relax."):
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in modules else _owner(base, modules)
                    arrow(target, node.lineno, full)
                    if full in modules:
                        bound[alias.asname or alias.name] = full
        for node in nodes:  # ``runner._call`` where ``runner`` is a module of another distribution
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                target = bound.get(node.value.id)
                if target and modules[target].distribution != module.distribution:
                    module.privates.append(f"{_where(module)}:{node.lineno}: {target}.{node.attr}")
    return modules


def room_of(name: str) -> str:
    """``relax.core.controller.fleet`` -> ``relax.core.controller``; ``relax.core.plugins`` stays
    itself; ``relax.megatron.trainer`` -> ``relax.megatron``."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[1] == "core" else ".".join(parts[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of more than one node."""
    return [_shortest_cycle(graph, c) for c in components(graph)]


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan): each is one circle or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(root: str) -> None:  # iterative, so deep graphs cannot exhaust the recursion limit
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


def file_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    return {name: set(m.imports) for name, m in modules.items()}


def room_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for name, m in modules.items():
        arrows = rooms.setdefault(room_of(name), set())
        arrows.update(room_of(t) for t in m.imports if room_of(t) != room_of(name))
    return rooms


def _explain(graph: dict[str, set[str]], modules: dict[str, Module] | None = None) -> str:
    lines = []
    for component in components(graph):
        cycle = _shortest_cycle(graph, component)
        lines.append(
            " -> ".join(cycle) + f"   (one circle of {len(component)}: {', '.join(sorted(component))})"
        )
        if modules is not None:  # for a room cycle: which files carry each arrow
            for a, b in zip(cycle, cycle[1:], strict=False):
                carriers = sorted(
                    f"{n} -> {t}"
                    for n, m in modules.items()
                    if room_of(n) == a
                    for t in m.imports
                    if room_of(t) == b
                )
                lines.extend(f"    {c}" for c in carriers)
    return "\n".join(lines)


MODULES = scan(discover())


def test_the_graph_covers_every_distribution_and_sees_lazy_imports():
    """The scan is the graph Python runs: it finds all five packages and the in-function imports."""
    assert {m.distribution for m in MODULES.values()} >= {
        "relax-core",
        "relax-megatron",
        "relax-sglang",
        "relax-rewards",
        "relax-omni",
    }
    assert len(MODULES) > 150
    # relax.rewards builds on core: an arrow across the namespace, resolved through packages/*/src
    assert any(
        room_of(t) == "relax.core.rewards"
        for n, m in MODULES.items()
        if n.startswith("relax.rewards")
        for t in m.imports
    )
    # lazy_ray imports ray only inside functions; the CLI imports the controller's run lazily
    assert "relax.core.controller.run" in MODULES["relax.core.cli"].imports


def test_cycle_finder_reports_a_cycle_and_passes_a_dag():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_scan_skips_type_checking_and_flags_foreign_privates(tmp_path):
    files = {
        "relax-a/src/relax/a/x.py": "def _p(): pass\n",
        "relax-b/src/relax/b/y.py": "",
        "relax-b/src/relax/b/z.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relax.b import y\n"
            "def f():\n    from relax.a.x import _p\n    import relax.a.x as ax\n    return ax._p\n"
        ),
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    found = scan(discover(tmp_path))
    assert found["relax.b.z"].imports == {"relax.a.x"}  # the TYPE_CHECKING import of relax.b.y is left out
    assert [p.split(": ", 1)[1] for p in found["relax.b.z"].privates] == ["relax.a.x._p", "relax.a.x._p"]


def test_no_import_cycle_among_files():
    graph = file_graph(MODULES)
    if cycles(graph):
        pytest.fail("import cycles among files:\n" + _explain(graph), pytrace=False)


def test_no_import_cycle_among_rooms():
    """Every room imports only rooms below it (an upward import closes a cycle here)."""
    graph = room_graph(MODULES)
    if cycles(graph):
        pytest.fail(
            "import cycles among rooms (a room imports one above it):\n" + _explain(graph, MODULES),
            pytrace=False,
        )


def test_no_package_imports_a_private_name_of_another_package():
    found = [p for m in MODULES.values() for p in m.privates]
    if found:
        pytest.fail(
            "underscore names imported across distribution packages:\n" + "\n".join(found), pytrace=False
        )


def test_the_contract_is_on_the_ground_floor():
    """The contract files import no relax module at all, so a plugin that reads them loads nothing of
    core's machinery (``docs/architecture.md``'s ground floor). A re-export from an upper room (the
    ``ModelStep`` protocol once came from ``policy_update``, pulling in ``algorithms/``) fails here."""
    for name in ("relax.core.protocols", "relax.core.hookspecs", "relax.core.context"):
        assert MODULES[name].imports == set(), f"{name} imports {sorted(MODULES[name].imports)}"
