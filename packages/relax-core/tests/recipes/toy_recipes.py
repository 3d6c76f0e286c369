"""A toy recipe plugin for core's recipe machinery: one text dataset (``toy-sums``: ``{question, answer}`` JSON
Lines as "published") and one recipe on it, registered through the same hooks as relax-rewards' and
relax-omni's, in a manager with core's built-ins and nothing else installed."""

from __future__ import annotations

import json
import types
from pathlib import Path

from relax.core import builtin, plugins
from relax.core.hookspecs import hookimpl
from relax.core.plugins import RelaxPluginManager
from relax.core.recipes import RowError, SourceRow, register_smoke_inputs

TEMPLATE = """\
# Recipe: GRPO on a toy model with toy-sums, sized for 1 node x 1 GPUs (80 GB).
# Written for the tests of core's recipe machinery; its smoke variant: examples/none.yaml
#   relax data prepare toy-sums --source owner/toy-sums --heldout 2
name: toy-grpo
run_dir: runs/toy-grpo
mode: async
max_staleness: 1            # rollout may run one policy version ahead of training
model:
  path: models/Toy-1B
data:
  path: data/toy-sums/train.jsonl
reward:
  name: numeric
eval:
  sets:
    heldout:
      path: data/toy-sums/heldout.jsonl
"""


def convert(src: SourceRow, out) -> tuple[dict, str]:
    question, answer = src.row.get("question"), src.row.get("answer")
    if not isinstance(question, str) or not question:
        raise RowError("no question")
    if answer is None:
        raise RowError("no answer", f"question {question!r}")
    return {"prompt": question, "label": str(answer)}, question


def write_fixture(directory: Path, rows: int) -> Path:
    good = [{"question": f"{i}+{i}", "answer": 2 * i} for i in range(rows)]
    bad = [{"question": "", "answer": 1}, {"question": "9+9"}]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*good, *bad]))
    return directory


def toy_plugin(**dataset_fields) -> types.ModuleType:
    plugin = types.ModuleType("toy_recipes")
    fields = {
        "hub_id": "owner/toy-sums",
        "summary": "sums",
        "reward": "numeric",
        "write_fixture": write_fixture,
        "heldout_rows": 2,
        **dataset_fields,
    }

    @hookimpl
    def relax_register_datasets(register):
        register("toy-sums", convert, **{k: v for k, v in fields.items() if v is not None})

    @hookimpl
    def relax_register_recipes(register):
        register(
            "toy-grpo",
            lambda: TEMPLATE,
            dataset="toy-sums",
            model="owner/Toy-1B",
            hardware="1 node x 1 GPUs (80 GB)",
            example="examples/toy.yaml",
            smoke="examples/none.yaml",
            modes=("async", "hybrid"),
            mode_fields={"hybrid": {"rollout.temperature": 0.5}},
            model_config=lambda: json.dumps({"hidden_size": 64}),
        )
        register(
            "orphan-grpo",
            lambda: TEMPLATE,
            dataset="not-installed",
            model="owner/Toy-1B",
            hardware="1 node x 1 GPUs (80 GB)",
            example="examples/toy.yaml",
            smoke="examples/none.yaml",
        )

    @hookimpl
    def relax_register_inputs(register):
        register_smoke_inputs(register, "toy-sums", lambda models: str(models / "toy-model"))

    plugin.relax_register_datasets = relax_register_datasets
    plugin.relax_register_recipes = relax_register_recipes
    plugin.relax_register_inputs = relax_register_inputs
    return plugin


def install(monkeypatch, plugin: types.ModuleType) -> RelaxPluginManager:
    manager = RelaxPluginManager(load_entry_points=False, extra_plugins={"core": builtin, "toy": plugin})
    monkeypatch.setattr(plugins, "_MANAGER", manager)
    return manager
