"""Held-out evaluation during a run (and for ``relax eval``): the ``eval`` sets, scored on the rollout engines.

Each set is loaded once, on first use, with the run's data settings (its own file, keys, reward and
environment where it names them). An evaluation generates every prompt's ``n_samples`` responses through
the run's router -- the same engines and weight version the next rollout uses (in async / hybrid modes the
producer keeps generating beside it) -- scores them with the set's reward and reports
``eval/<set>/<metric>`` (``relax.core.evaluation.report``), writes ``<run_dir>/eval/<set>/step_<N>.jsonl``
and appends a line to ``<run_dir>/eval/results.jsonl``. A set that cannot be evaluated (its file gone or
holding no usable rows, its reward unknown at start, raising or overrunning its timeout) is reported
``eval/<set>/failed = 1`` with the reason, and the run goes on; a lost engine still fails the run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relax.core.config import EvalSetConfig, RelaxConfig
from relax.core.controller import stages
from relax.core.controller.samples import build_groups, sampling_params
from relax.core.evaluation.report import completion_rows, set_metrics, write_jsonl

log = logging.getLogger("relax")
EVAL_GROUP_BASE = 1 << 40  # eval group ids: request ids never meet a training request's (step/group/index)


@dataclass
class LoadedSet:
    name: str
    spec: EvalSetConfig
    cfg: RelaxConfig  # the run's config with this set's data keys, reward and environment
    items: list[Any]
    dataset: Any
    reward: Any  # a reward role handle (the run's own when the set names none)
    own_reward: bool
    turns: Any
    params: Any  # SamplingParams


def set_config(cfg: RelaxConfig, spec: EvalSetConfig) -> RelaxConfig:
    """The run's config as one eval set sees it: its keys, reward, environment, sampling."""
    d = cfg.data
    metadata = [
        *d.metadata_keys,
        *([spec.source_key] if spec.source_key and spec.source_key not in d.metadata_keys else []),
    ]
    data = replace(
        d,
        path=spec.path,
        prompt_key=spec.prompt_key or d.prompt_key,
        label_key=spec.label_key or d.label_key,
        metadata_keys=metadata,
        shuffle=False,
    )
    rollout = replace(
        cfg.rollout,
        n_samples_per_prompt=spec.n_samples,
        top_p=spec.top_p,
        max_new_tokens=spec.max_new_tokens or cfg.rollout.max_new_tokens,
    )  # the temperature: in params
    return replace(
        cfg,
        data=data,
        rollout=rollout,
        reward=spec.reward or cfg.reward,
        environment=spec.environment or cfg.environment,
    )


class Evaluator:
    """The run's eval sets and schedule. ``run_reward`` / ``run_turns``: the run's reward role and multi-turn
    loop, used by sets that name no reward / environment of their own."""

    def __init__(
        self,
        cfg: RelaxConfig,
        tokenizer: Any,
        stop_token_ids: list[int],
        model_path: str,
        run_reward: Any = None,
        run_turns: Any = None,
        engines: Any = None,
        resume_step: int | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.stop_token_ids, self.model_path = (
            cfg,
            tokenizer,
            stop_token_ids,
            model_path,
        )
        self.run_reward, self.run_turns, self.engines = run_reward, run_turns, engines
        self.root = Path(cfg.run_dir) / "eval"
        self.loaded: dict[str, LoadedSet | str] = {}  # a set, or why it cannot be evaluated
        self.latest: dict[
            str, float
        ] = {}  # every set's latest result (the REST status shows it between evals)
        self.seconds = 0.0  # spent evaluating, in all
        if cfg.eval.sets:
            self._forget_after(resume_step if resume_step is not None else -1)

    def _forget_after(self, step: int) -> None:
        """A resumed run evaluates again what came after its checkpoint: earlier results only are kept."""
        index = self.root / "results.jsonl"
        if index.exists():
            lines = index.read_text(encoding="utf-8").splitlines()
            kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= step]
            index.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")

    def due(self, step: int) -> bool:
        ev = self.cfg.eval
        if not ev.sets:
            return False
        if step == 0:
            return ev.before_train
        return bool(ev.every_n_steps and step % ev.every_n_steps == 0) or (
            ev.at_end and step == self.cfg.total_steps
        )

    def evaluate(self, router: Any, step: int, version: int) -> dict[str, float]:
        """Every set at ``step`` with the engines at weight ``version``; ``eval/<set>/<metric>`` metrics."""
        started, out = time.perf_counter(), {}
        for name in self.cfg.eval.sets:
            out.update(self._one(name, router, step, version))
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        out["time/eval_s"] = elapsed
        self.latest.update({k: v for k, v in out.items() if k.startswith("eval/")})
        return out

    # ------------------------------------------------------------------ one set

    def _one(self, name: str, router: Any, step: int, version: int) -> dict[str, float]:
        started = time.perf_counter()
        loaded = self._load(name)
        if isinstance(loaded, str):
            return self._failed(name, step, version, loaded)
        groups = self._groups(loaded, step)
        samples = [s for g in groups for s in g]
        stages.generate(
            router, groups, loaded.cfg, step, self.stop_token_ids, params=loaded.params, turns=loaded.turns
        )
        try:
            scored, _ = stages.score(loaded.reward, samples, loaded.cfg)
        except Exception as exc:  # noqa: BLE001  # a reward that raises or hangs fails this eval, not the run
            return self._failed(
                name, step, version, f"reward {loaded.cfg.reward.name!r}: {type(exc).__name__}: {exc}"
            )
        by_group: dict[int, list[Any]] = {}
        for s in scored:
            by_group.setdefault(s.group_id, []).append(s)
        regrouped = [sorted(g, key=lambda s: s.index_in_group) for _, g in sorted(by_group.items())]
        metrics = set_metrics(regrouped, loaded.spec.source_key)
        versions = [v for s in scored for v in s.versions]
        version = min(
            versions, default=version
        )  # the weights that wrote the responses (async: may lag the trainer)
        metrics.update(
            failed=0.0,
            version=float(version),
            time_s=time.perf_counter() - started,
            sample_version_min=float(min(versions, default=version)),
            sample_version_max=float(max(versions, default=version)),
        )
        rows = completion_rows(regrouped, step, version, loaded.spec.source_key)
        write_jsonl(self.root / name / f"step_{step}.jsonl", rows)
        self._record(name, step, version, "ok", None, metrics)
        return {f"eval/{name}/{k}": v for k, v in metrics.items()}

    def _failed(self, name: str, step: int, version: int, reason: str) -> dict[str, float]:
        log.warning("eval set %r at step %d failed: %s (training continues)", name, step, reason)
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"step_{step}.failed.txt").write_text(reason + "\n", encoding="utf-8")
        self._record(name, step, version, "failed", reason, {})
        return {f"eval/{name}/failed": 1.0, f"eval/{name}/version": float(version)}

    def _record(
        self, name: str, step: int, version: int, status: str, reason: str | None, metrics: dict[str, float]
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        row = {
            "step": step,
            "set": name,
            "version": version,
            "status": status,
            "reason": reason,
            "metrics": metrics,
        }
        with (self.root / "results.jsonl").open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")

    def _groups(self, loaded: LoadedSet, step: int) -> list[list[Any]]:
        items, shared = loaded.items, None
        if getattr(loaded.dataset, "multimodal", False):  # media are processed for each evaluation
            from relax.core.data_multimodal import draw_multimodal

            items, shared = draw_multimodal(loaded.dataset, items)
        groups = build_groups(items, step, loaded.cfg, EVAL_GROUP_BASE)
        for group, ref in zip(groups, shared or (), strict=False):
            for sample in group:
                sample.mm_inputs = ref
        return groups

    # ------------------------------------------------------------------ loading

    def _load(self, name: str) -> LoadedSet | str:
        if name not in self.loaded:
            try:
                self.loaded[name] = self._build(name, self.cfg.eval.sets[name])
            except Exception as exc:  # noqa: BLE001  # a bad set is named, once per evaluation; the run goes on
                self.loaded[name] = f"cannot load: {type(exc).__name__}: {exc}"
        return self.loaded[name]

    def _build(self, name: str, spec: EvalSetConfig) -> LoadedSet:
        from relax.core.controller.runtime import build_dataset, heldout_data_path, resolve_data_path

        if spec.path is None:  # the quick-start's held-out split, written with its training file
            resolve_data_path(self.cfg, Path(self.cfg.run_dir))
            spec = replace(spec, path=str(heldout_data_path(self.cfg)))
        cfg = set_config(self.cfg, spec)
        dataset = build_dataset(
            replace(cfg, rollout=replace(cfg.rollout, prompts_per_step=1)),
            self.tokenizer,
            spec.path,
            self.model_path,
        )
        items = dataset.items[: spec.max_prompts] if spec.max_prompts else list(dataset.items)
        params = replace(sampling_params(cfg, self.stop_token_ids), temperature=spec.temperature, top_k=0)
        own_reward = spec.reward is not None or self.run_reward is None  # relax eval: no run reward to share
        reward = self._reward(cfg) if own_reward else self.run_reward
        turns = self.run_turns
        if spec.environment is not None:
            from relax.core.controller.episodes import build_turns

            turns = build_turns(cfg, self.tokenizer, self.stop_token_ids, self.model_path, dataset.processor)
        log.info("eval set %r: %d prompts x %d samples from %s", name, len(items), spec.n_samples, spec.path)
        return LoadedSet(name, spec, cfg, items, dataset, reward, own_reward, turns, params)

    def _reward(self, cfg: RelaxConfig) -> Any:
        """The set's own reward role: in the driver when declared so (or no Ray runs), else its own actor."""
        import ray

        from relax.core.controller.contexts import reward_context
        from relax.core.controller.driver_reward import start_reward
        from relax.core.controller.roles import RewardRole
        from relax.core.lazy_ray import LocalHandle

        derive = getattr(
            cfg.reward.params, "group_timeout_s", None
        )  # the hub derives its bound from its own limits
        if callable(derive):
            timeout_s = max(cfg.reward.timeout_s, float(derive(cfg.rollout.n_samples_per_prompt)))
            cfg = replace(cfg, reward=replace(cfg.reward, timeout_s=timeout_s))
        ctx = reward_context(cfg, self.model_path, list(self.engines or []))
        if ray.is_initialized():
            return start_reward(cfg, ctx)
        return LocalHandle(RewardRole.__ray_actor_class__(cfg, ctx))

    def close(self) -> None:
        """The sets' own reward roles: closed, their actors killed."""
        from relax.core.controller import closing

        own = [s.reward for s in self.loaded.values() if isinstance(s, LoadedSet) and s.own_reward]
        turns = [
            s.turns
            for s in self.loaded.values()
            if isinstance(s, LoadedSet) and s.turns is not self.run_turns
        ]
        closing.run_all([("eval turns", lambda: [t.close() for t in turns if t is not None])])
        if own:
            closing.close_roles(own, self.cfg.rollout.control_timeout_s)
            import ray

            from relax.core.weight_sync.base import is_actor

            for handle in own:
                if is_actor(handle):
                    ray.kill(handle)
