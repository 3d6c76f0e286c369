"""Build the agent quick-start's files once: the warmed-up model (cached by recipe) and the task data."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from relax.agents.quickstart import model as model_recipe
from relax.agents.quickstart.task import problem_rows, write_rows
from relax.agents.quickstart.warmup import WarmupConfig, warm_up

DEFAULT_MODEL = "runs/agent-quickstart/model"
DEFAULT_DATA = "runs/agent-quickstart/data/train.jsonl"
_FORMAT_VERSION = 1  # bump when the recipe changes in a way the fields below do not show
_RECIPE_FILE = "relax_agent_quickstart.json"
WARMUP = WarmupConfig()  # the quick-start's recipe


@dataclasses.dataclass(frozen=True)
class QuickstartInputs:
    """``inputs.params`` of ``agent_quickstart``: the task rows written into ``<run_dir>/data``."""

    rows: int = 2000
    seed: int = 0


def recipe_fingerprint(warmup: WarmupConfig = WARMUP) -> str:
    """Short hash of everything that determines the model files."""
    recipe = {
        "format": _FORMAT_VERSION,
        "vocab": model_recipe.SPECIAL_TOKENS + model_recipe.WORDS + model_recipe.CHARS,
        "template": model_recipe.CHAT_TEMPLATE,
        "model": model_recipe.AGENT_MODEL,
        "warmup": dataclasses.asdict(warmup),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _build(directory: Path, warmup: WarmupConfig) -> None:
    tokenizer = model_recipe.build_tokenizer()
    model = model_recipe.build_model(tokenizer, seed=warmup.seed)
    losses = warm_up(model, tokenizer, warmup)
    model_recipe.save(model, tokenizer, directory)
    (directory / _RECIPE_FILE).write_text(
        json.dumps(
            {
                "fingerprint": recipe_fingerprint(warmup),
                "warmup": dataclasses.asdict(warmup),
                "final_loss": losses[-1],
            }
        )
    )


def _is_current(directory: Path, warmup: WarmupConfig) -> bool:
    try:
        return json.loads((directory / _RECIPE_FILE).read_text())["fingerprint"] == recipe_fingerprint(warmup)
    except (OSError, ValueError, KeyError):
        return False


def ensure_agent_model(directory: str | os.PathLike[str] | None = None, warmup: WarmupConfig = WARMUP) -> str:
    """Path of the warmed-up model, building it (tens of seconds on CPU) unless already there.

    ``directory`` None: ``<$RELAX_CACHE_DIR or ~/.cache/relax>/agent-quickstart-<fingerprint>``.
    A directory built from another recipe is rebuilt. Built in a temporary sibling and renamed into
    place, so concurrent callers never see a half-written model."""
    if directory is None:
        root = Path(os.environ.get("RELAX_CACHE_DIR") or Path.home() / ".cache" / "relax")
        target = root / f"agent-quickstart-{recipe_fingerprint(warmup)}"
    else:
        target = Path(directory)
    if _is_current(target, warmup):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".agent-quickstart-build-", dir=target.parent))
    try:
        _build(tmp, warmup)
        if target.exists() and not _is_current(target, warmup):
            shutil.rmtree(target, ignore_errors=True)  # an older recipe
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current(target, warmup):  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def ensure_task_data(path: str | os.PathLike[str] = DEFAULT_DATA, n: int = 2000, seed: int = 0) -> str:
    """The task's JSONL (``prompt``/``label``), written unless a file is already there."""
    return str(path) if Path(path).exists() else write_rows(path, problem_rows(n, seed))


def prepare(
    model_dir: str | os.PathLike[str] = DEFAULT_MODEL, data_path: str | os.PathLike[str] = DEFAULT_DATA
) -> tuple[str, str]:
    """Both files ``examples/quickstart_agent*.yaml`` point at: the model is built once in the
    cache and copied to ``model_dir``."""
    cached = ensure_agent_model()
    if not _is_current(Path(model_dir), WARMUP):
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.copytree(cached, model_dir)
    return str(model_dir), ensure_task_data(data_path)
