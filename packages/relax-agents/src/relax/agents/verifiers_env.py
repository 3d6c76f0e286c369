"""``verifiers``: a ``verifiers`` (0.4, ``verifiers.v1``) environment as a Relax environment + reward.

Built on ``openai_agent``: each Relax episode runs one verifiers episode (``Env.run_episode``: the
task's harness, tools, ``@vf.reward`` rubric) whose model endpoint is the episode's session, so every
model call the harness makes is answered with the turn Relax sampled, and the rubric's reward (the
sum of its traces' weighted rewards) is the episode's. Numeric trace metrics become ``episode/<name>``.

One verifiers ``serving()`` context (its interception server, shared tool servers) lives on one
background event loop per environment; episodes from many threads run on it at once.

The dataset: :func:`export_dataset` writes the environment's tasks as a Relax JSONL whose
``prompt`` is the messages the harness opens with (system prompt + prompt) and whose ``vf_task``
is the task's data, which the episode rebuilds the task from (``data.metadata_keys: [vf_task]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.agents.openai_env import OpenAIAgentEnvironment, OpenAIAgentParams, check_params, import_ref


@dataclass(frozen=True)
class VerifiersParams:
    """``environment.params`` of ``verifiers``."""

    env: str = (
        ""  # "module:function" returning a verifiers.v1 Env, or an EnvConfig (built with vf.load_environment)
    )
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    task_key: str = "vf_task"  # the dataset field (listed in data.metadata_keys) holding the task's data
    model: str = "relax"  # the model name verifiers sends
    call_timeout_s: float = 600.0  # see openai_agent
    episode_timeout_s: float = 3600.0  # longest one verifiers episode may run (its own timeouts apply inside)
    check_prompt: bool = True
    keep_sessions: int = 256

    def validate(self) -> list[str]:
        errors = check_params(self, "env", self.env)
        return errors + (
            []
            if self.episode_timeout_s > 0
            else [f"episode_timeout_s: must be > 0, got {self.episode_timeout_s}"]
        )


def load_env(ref: str, kwargs: dict[str, Any] | None = None) -> Any:
    """The verifiers ``Env`` that ``module:function`` returns (an ``EnvConfig`` is loaded for you)."""
    import verifiers.v1 as vf

    made = import_ref(ref, "env")(**(kwargs or {}))
    if isinstance(made, vf.EnvConfig):
        made = vf.load_environment(made)
    if not isinstance(made, vf.Env):
        raise ValueError(
            f"environment.params.env: {ref!r} returned {type(made).__name__}, not a verifiers.v1 Env or EnvConfig"
        )
    return made


class VerifiersRunner:
    """Runs verifiers episodes on one background loop that holds ``env.serving()`` open."""

    def __init__(self, env: Any, params: VerifiersParams) -> None:
        self.env, self.params = env, params
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="verifiers-serving", daemon=True)
        self._thread.start()
        if not self._ready.wait(120) or self._failed is not None:
            raise RuntimeError(f"verifiers: env.serving() did not start ({self._failed!r})")

    def _serve(self) -> None:
        async def hold() -> None:
            self._stop = asyncio.Event()
            try:
                async with self.env.serving():
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as exc:  # noqa: BLE001 - reported by __init__
                self._failed = exc
                self._ready.set()

        self._loop.run_until_complete(hold())

    def task(self, data: Any) -> Any:
        """The task for one row's ``vf_task`` (its data as exported)."""
        if isinstance(data, str):
            data = json.loads(data)
        taskset = self.env.taskset
        task_cls = type(taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(data), taskset.config.task)

    def run(self, task: Any, base_url: str) -> Any:
        import verifiers.v1 as vf

        client = vf.EvalClientConfig(base_url=base_url, api_key_var="RELAX_VERIFIERS_API_KEY")
        ctx = vf.ModelContext(model=self.params.model, client=client, sampling=vf.SamplingConfig())
        future = asyncio.run_coroutine_threadsafe(self.env.run_episode(task, ctx), self._loop)
        return future.result(timeout=self.params.episode_timeout_s)

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    def agent(self, client: Any, row: dict[str, Any]) -> dict[str, float]:
        """The ``openai_agent`` agent: one verifiers episode against this session's endpoint."""
        data = row["metadata"].get(self.params.task_key)
        if data is None:
            raise ValueError(
                f"verifiers: the row has no {self.params.task_key!r}; add it to data.metadata_keys "
                "(rows written by relax.agents.verifiers_env.export_dataset carry it)"
            )
        episode = self.run(self.task(data), str(client.base_url).rstrip("/"))
        if not episode.ok:
            errors = "; ".join(f"{e.type}: {e.message}" for t in episode.traces for e in t.errors)
            errors = errors or "; ".join(f"{e.type}: {e.message}" for e in episode.errors)
            raise RuntimeError(f"verifiers episode failed: {errors or 'no trace finished'}")
        metrics = {
            k: float(v) for t in episode.traces for k, v in t.metrics.items() if isinstance(v, int | float)
        }
        return {**metrics, "reward": sum(t.reward for t in episode.traces)}


class VerifiersEnvironment(OpenAIAgentEnvironment):
    """``openai_agent`` whose agent is a :class:`VerifiersRunner` (stopped with the server on ``close``)."""

    def __init__(self, params: VerifiersParams, tokenizer: Any, env: Any | None = None) -> None:
        self.runner = VerifiersRunner(
            env if env is not None else load_env(params.env, params.env_kwargs), params
        )
        agent_params = OpenAIAgentParams(
            model=params.model,
            call_timeout_s=params.call_timeout_s,
            check_prompt=params.check_prompt,
            keep_sessions=params.keep_sessions,
        )
        super().__init__(agent_params, tokenizer, agent=self.runner.agent)

    def close(self) -> None:
        super().close()
        self.runner.close()


def verifiers_environment(params: VerifiersParams, ctx: Any) -> VerifiersEnvironment:
    """The registered factory: the tokenizer comes from the run's model."""
    from transformers import AutoTokenizer

    if not params.env:
        raise ValueError(
            "environment.params.env: set it to the verifiers environment factory, 'module:function'"
        )
    return VerifiersEnvironment(params, AutoTokenizer.from_pretrained(ctx.tokenizer_path or ctx.model_path))


# ---------------------------------------------------------------------- the dataset
def task_rows(env: Any, limit: int | None = None, task_key: str = "vf_task") -> Iterator[dict[str, Any]]:
    """One Relax row per task: ``prompt`` (the opening messages), ``label`` (the task's ``answer`` if
    it has one), ``vf_task`` (the task's data, to rebuild it from)."""
    tasks = env.taskset if limit is None else env.taskset.take(limit)
    for task in tasks:
        data = task.data.model_dump(mode="json", exclude_none=True)
        prompt = task.data.prompt
        if prompt is None:
            raise ValueError(
                f"verifiers: task {task.data.idx} has no prompt (a user-opened task cannot be a Relax prompt)"
            )
        messages = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else [m.model_dump(mode="json", exclude_none=True) for m in prompt]
        )
        if task.data.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": task.data.system_prompt})
        yield {"prompt": messages, "label": data.get("answer"), task_key: data}


def export_dataset(env: Any, path: str | Path, limit: int | None = None, task_key: str = "vf_task") -> int:
    """Write ``env``'s tasks (an ``Env``, or ``module:function``) to ``path`` as JSONL; returns the row count.
    Train on it with ``data.path: <path>``, ``data.metadata_keys: [vf_task]``."""
    env = load_env(env) if isinstance(env, str) else env
    n = 0
    with Path(path).open("w") as out:
        for row in task_rows(env, limit, task_key):
            out.write(json.dumps(row) + "\n")
            n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m relax.agents.verifiers_env",
        description="Write a verifiers environment's tasks as a Relax JSONL dataset.",
    )
    parser.add_argument("env", help="module:function returning a verifiers.v1 Env or EnvConfig")
    parser.add_argument("out", help="the .jsonl to write")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    args = parser.parse_args(argv)
    print(f"wrote {export_dataset(args.env, args.out, args.limit)} rows to {args.out}")


if __name__ == "__main__":
    main()
