"""``relax eval CONFIG --model DIR``: the config's ``eval`` sets on any model, without training.

``--model`` is an HF model directory, a run directory (its ``final_hf``) or a Relax checkpoint
(``<run_dir>/checkpoints/step_N``: converted to an HF directory first, under the output directory). The
engine and reward run in this process, as the quick-start's do (``rollout.host: driver``); the files are
those a run writes (``<out>/eval/<set>/step_<N>.jsonl``, ``<out>/eval/results.jsonl``, ``<out>/metrics.jsonl``)
and a table is printed. Exit 0: every set evaluated; 1: a set failed (its reason printed); 2: bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from relax.core.errors import ConfigError


class EvalInputError(ValueError):
    """``relax eval`` cannot start: the reason names the argument or the config field."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "args", nargs="*", help="config.yaml [key.path=value ...] (its eval.sets are evaluated)"
    )
    parser.add_argument(
        "--model", default=None, help="HF model dir, run dir (final_hf) or checkpoint (default: model.path)"
    )
    parser.add_argument("--out", default=None, help="where the files go (default: <run_dir>/relax_eval)")
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="the step the files are named by (default: the checkpoint's, else 0)",
    )


def _checkpoint_step(path: Path) -> int | None:
    from relax.core.checkpoint import CONTROLLER_STATE, read_controller_state

    return int(read_controller_state(path)["step"]) if (path / CONTROLLER_STATE).is_file() else None


def _torch_checkpoint_to_hf(checkpoint: Path, out: Path) -> None:
    """The built-in torch trainer's checkpoint (one ``trainer_state.pt``) into the model it started from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.checkpoint import read_controller_state

    source = read_controller_state(checkpoint).get("model_path")
    if not source or not Path(source).is_dir():
        raise EvalInputError(
            f"--model {checkpoint}: the model the run started from ({source}) is gone; "
            "convert it with relax convert"
        )
    state = torch.load(checkpoint / "trainer" / "trainer_state.pt", map_location="cpu", weights_only=True)
    if state.get("lora", False):
        raise EvalInputError(f"--model {checkpoint}: a LoRA checkpoint; evaluate the run's final_hf instead")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.load_state_dict(state["model"])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)


def resolve_model(arg: str, out: Path) -> tuple[str, int]:
    """(HF model directory, step) for ``--model``: an HF dir, a run dir's final_hf, or a checkpoint converted."""
    path = Path(arg)
    if not path.is_dir():
        raise EvalInputError(f"--model {arg}: no such directory")
    if (path / "config.json").is_file():
        return str(path), 0
    if (path / "final_hf" / "config.json").is_file():
        steps = [_checkpoint_step(c) for c in sorted((path / "checkpoints").glob("step_*"))]
        return str(path / "final_hf"), max([s for s in steps if s is not None], default=0)
    step = _checkpoint_step(path)
    if step is None:
        raise EvalInputError(
            f"--model {arg}: neither an HF model directory (config.json), a run directory (final_hf) "
            "nor a Relax checkpoint (controller.json)"
        )
    target = out / f"model_step_{step}"
    if not (target / "config.json").is_file():
        if (path / "trainer" / "trainer_state.pt").is_file():
            _torch_checkpoint_to_hf(path, target)
        else:
            from relax.core.convert import convert

            convert(str(path), str(target))
    return str(target), step


def evaluate_model(cfg: Any, model_arg: str | None, out: Path, step: int | None = None) -> dict[str, float]:
    """Every eval set of ``cfg`` on the model, engine and reward in this process; the ``eval/...`` metrics."""
    import dataclasses

    from transformers import AutoTokenizer

    from relax.core.controller.contexts import engine_context
    from relax.core.controller.evaluator import Evaluator
    from relax.core.controller.roles import RolloutRole
    from relax.core.controller.router import EngineRouter
    from relax.core.controller.runtime import resolve_model_path
    from relax.core.engines.stop_tokens import stop_token_ids
    from relax.core.lazy_ray import LocalHandle
    from relax.core.metrics import MetricsLogger

    if not cfg.eval.sets:
        raise EvalInputError("eval.sets: the config names no eval set")
    out.mkdir(parents=True, exist_ok=True)
    model_path, found_step = resolve_model(model_arg, out) if model_arg else (resolve_model_path(cfg), 0)
    step = found_step if step is None else step
    sets = {
        n: s if s.path is not None else dataclasses.replace(s, path=str(_heldout(cfg)))
        for n, s in cfg.eval.sets.items()
    }
    cfg = dataclasses.replace(
        cfg,
        run_dir=str(out),
        model=dataclasses.replace(cfg.model, path=model_path),
        eval=dataclasses.replace(cfg.eval, sets=sets),
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stops = stop_token_ids(tokenizer)
    engine = LocalHandle(RolloutRole.__ray_actor_class__(cfg, engine_context(cfg, model_path, 0)))
    evaluator = Evaluator(cfg, tokenizer, stops, model_path, engines=[engine])
    try:
        metrics = evaluator.evaluate(EngineRouter([engine]), step, version=step)
    finally:
        evaluator.close()
        engine.close.remote()
    with MetricsLogger(out, backends=()) as logger:
        logger.log(step, {"step": float(step), **metrics})
    return {"step": float(step), **metrics}


def _heldout(cfg: Any) -> Path:
    from relax.core.controller.runtime import heldout_data_path, resolve_data_path

    resolve_data_path(cfg, Path(cfg.run_dir))  # the quick-start's task, with its held-out split
    return heldout_data_path(cfg)


def format_table(metrics: dict[str, float], names: list[str]) -> str:
    """One line per set: prompts, accuracy, then pass@k / maj@k / mean@k and lengths, or FAILED."""
    lines = []
    for name in names:
        prefix = f"eval/{name}/"
        mine = {
            k[len(prefix) :]: v
            for k, v in metrics.items()
            if k.startswith(prefix) and "/" not in k[len(prefix) :]
        }
        if mine.get("failed"):
            lines.append(f"{name:<16} FAILED")
            continue
        keys = ["prompts", "accuracy", *sorted(k for k in mine if "@" in k), "truncated_frac"]
        mine["truncated_frac"] = metrics.get(prefix + "response/truncated_frac", 0.0)
        lines.append(f"{name:<16} " + "  ".join(f"{k} {mine[k]:.4g}" for k in keys if k in mine))
    return "\n".join(lines)


def cmd_eval(ns: argparse.Namespace) -> int:
    from relax.core.config import load_config

    try:
        path, overrides = (ns.args[0], ns.args[1:]) if ns.args and "=" not in ns.args[0] else (None, ns.args)
        cfg = load_config(path, overrides, check_paths=True)
        out = Path(ns.out or Path(cfg.run_dir) / "relax_eval")
        metrics = evaluate_model(cfg, ns.model, out, ns.step)
    except (ConfigError, EvalInputError) as exc:
        print(f"relax eval: {exc}", file=sys.stderr)
        return 2
    names = list(cfg.eval.sets)
    print(format_table(metrics, names))
    print(f"relax eval: completions in {out}/eval/<set>/, results in {out}/eval/results.jsonl")
    failed = [n for n in names if metrics.get(f"eval/{n}/failed")]
    for name in failed:
        reason = (out / "eval" / name / f"step_{int(metrics.get('step', 0))}.failed.txt").read_text().strip()
        print(f"relax eval: set {name!r} failed: {reason}", file=sys.stderr)
    return 1 if failed else 0
