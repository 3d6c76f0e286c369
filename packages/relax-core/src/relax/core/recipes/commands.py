"""The built-in ``relax data prepare`` and ``relax init`` subcommands (added by ``relax.core.cli``)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from relax.core.recipes.starter import MODES

_MISSING = re.compile(
    r"^  (data\.path|eval\.sets\.[^:]+\.path): '([^']*?)([^/']+)/([^/']+)\.jsonl' does not exist.*$",
    re.MULTILINE,
)


def _hint(m: re.Match[str]) -> str:
    from relax.core.recipes.catalog import datasets

    spec = datasets().get(m.group(3))
    if spec is None or m.group(4) not in ("train", "heldout", spec.heldout_split):
        return m.group(0)
    out, split = m.group(2) + m.group(3), m.group(4)
    where = "" if out == f"data/{spec.name}" else f" --out {out}"
    extra = f" --split {split}" if split == spec.heldout_split else f" --heldout {spec.heldout_rows}"
    extra = "" if extra == " --heldout 0" else extra
    return (
        f"{m.group(0)} -- make it with: relax data prepare {spec.name} --source {spec.hub_id}{where}{extra}"
    )


@contextmanager
def with_prepare_hint() -> Iterator[None]:
    """A ``ConfigError`` whose ``data.path`` (or an eval set's path) is a missing ``.../<dataset>/<split>.jsonl``
    of a recipe's dataset gets the ``relax data prepare`` command that writes it."""
    from relax.core.errors import ConfigError

    try:
        yield
    except ConfigError as exc:
        text = _MISSING.sub(_hint, str(exc))
        if text == str(exc):
            raise
        raise ConfigError(text) from None


def cmd_prepare(ns: argparse.Namespace) -> int:
    from relax.core.recipes.catalog import dataset_of, recipes
    from relax.core.recipes.output import report_name
    from relax.core.recipes.prepare import prepare, prepare_smoke
    from relax.core.recipes.sources import SourceError

    try:
        spec = dataset_of(ns.recipe)
    except KeyError as exc:
        print(f"relax: {exc.args[0]}", file=sys.stderr)
        return 2
    if ns.smoke == (ns.source is not None):
        print(
            f"relax: data prepare {ns.recipe}: give --source (a directory, a file or a Hub id such as "
            f"{spec.hub_id}) or --smoke (fixture rows), not both",
            file=sys.stderr,
        )
        return 2
    if ns.heldout < 0:
        print(f"relax: data prepare {spec.name}: --heldout must be >= 0, got {ns.heldout}", file=sys.stderr)
        return 2
    try:
        if ns.smoke:
            report = prepare_smoke(spec.name, ns.out, ns.rows, ns.heldout)
        else:
            report = prepare(spec.name, ns.source, ns.out, split=ns.split, limit=ns.limit, heldout=ns.heldout)
    except SourceError as exc:
        print(f"relax: data prepare {spec.name}: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    if report.rows == 0:
        print(
            f"relax: data prepare {spec.name}: no row could be converted (see the reasons above)",
            file=sys.stderr,
        )
        return 1
    users = [r for r in recipes().values() if r.dataset == spec.name]
    print(
        f"report: {Path(report.path).parent / report_name(ns.split)}; used by "
        + (", ".join(f"{r.name} ({r.example})" for r in users) or "no installed recipe")
    )
    return 0


def cmd_init(ns: argparse.Namespace) -> int:
    from relax.core.recipes.catalog import dataset_of, listing, recipe_of
    from relax.core.recipes.starter import default_file, write_starter

    if ns.list:
        print(listing())
        return 0
    path = write_starter(ns.out or default_file(ns.recipe), ns.recipe, ns.mode, ns.force)
    print(f"wrote {path}")
    if ns.recipe:
        recipe = recipe_of(ns.recipe)
        try:
            spec = dataset_of(recipe.name)
            prepare = f"relax data prepare {spec.name} --source {spec.hub_id}"
        except KeyError as exc:  # its dataset's plugin is not installed: say so, the config is written
            prepare = f"(cannot prepare its data yet: {exc.args[0]})"
        print(
            f"next: download {recipe.model} into the config's model.path, then\n"
            f"  {prepare}\n"
            f"  relax validate {path}\n  relax run {path}\n"
            f"or try it on CPU first: relax run {recipe.smoke} (from a clone of the repository)"
        )
    else:
        print(f"next: relax run {path}   (edit model.path / data.path for your own model and data)")
    return 0


def add_recipe_commands(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="prepare datasets for the recipes")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser(
        "prepare",
        help="convert a published dataset into Relax JSONL + media files",
        description="Convert a published dataset (its own schema) into Relax rows; malformed rows are skipped "
        "and counted per reason. The datasets are those the installed plugins register: relax init --list.",
    )
    prepare.add_argument("recipe", help="dataset or recipe name")
    prepare.add_argument("--source", help="a local directory or file as published, or a Hub id (downloads)")
    prepare.add_argument("--out", help="output directory (default: data/<dataset>, where the recipes look)")
    prepare.add_argument(
        "--split",
        default="train",
        help="split to convert, written to <out>/<split>.jsonl (default: train; a dataset's published "
        "held-out split, e.g. valid, for its recipes' eval set)",
    )
    prepare.add_argument(
        "--heldout",
        type=int,
        default=0,
        metavar="N",
        help="keep N rows out of <split>.jsonl, in <out>/heldout.jsonl (the recipes' eval set "
        "where the dataset publishes no held-out split; chosen by hash, the same every run)",
    )
    prepare.add_argument("--limit", type=int, help="stop after this many rows are written")
    prepare.add_argument(
        "--smoke",
        action="store_true",
        help="write fixture rows in the published schema (to <out>/source) and convert those",
    )
    prepare.add_argument("--rows", type=int, default=8, help="--smoke: good fixture rows (default: 8)")
    prepare.set_defaults(fn=cmd_prepare)
    init = sub.add_parser("init", help="write a commented starter config (a recipe's, or the quick-start's)")
    init.add_argument("--recipe", help="start from a recipe's config (the installed ones: relax init --list)")
    init.add_argument("--mode", choices=MODES, help="execution mode (default: the template's own)")
    init.add_argument("--out", help="file to write (default: relax.yaml, or <recipe>.yaml)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.add_argument(
        "--list", action="store_true", help="list the installed recipes and datasets, with their packages"
    )
    init.set_defaults(fn=cmd_init)
