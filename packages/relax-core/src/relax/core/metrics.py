"""Per-step metrics fanned out to console, JSONL, TensorBoard, Weights & Biases and ClearML; webhooks.

``run_dir/metrics.jsonl`` is always written: it is what ``plot_curves`` reads and what survives when
no tracking service is configured. Heavy backends are imported only when enabled.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from relax.core.disk import disk_guard

log = logging.getLogger(__name__)

BACKENDS = ("console", "tensorboard", "wandb", "clearml")
DEFAULT_CONSOLE_KEYS = (
    "reward/mean",
    "response_length/mean",
    "loss/policy",
    "kl/mean",
    "grad_norm",
    "tokens_per_s",
    "time/step",
)


class MetricsError(RuntimeError):
    """A metrics backend is misconfigured or unavailable."""


class _Console:
    def __init__(self, keys: Sequence[str] | None, stream: TextIO) -> None:
        self.keys, self.stream = keys, stream

    def log(self, step: int, metrics: dict[str, float]) -> None:
        keys = [k for k in (self.keys or DEFAULT_CONSOLE_KEYS) if k in metrics]
        parts = [f"step {step}"] + [f"{k} {metrics[k]:.4g}" for k in keys]
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _step_of(line: str) -> float:
    """Step of a metrics.jsonl line; +inf for a line a crash left half-written (so it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


class _Jsonl:
    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        kept: list[str] = []
        if resume_step is not None and path.exists():
            kept = [ln for ln in path.read_text(encoding="utf-8").splitlines() if _step_of(ln) <= resume_step]
        with disk_guard("metrics", path):
            path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
            self.file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # NaN/inf are not JSON; write null so every reader can parse the file
        row = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        with disk_guard(f"metrics step {step}", self.path):
            self.file.write(json.dumps({"step": step, "timestamp": time.time(), **row}) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.file.close()


def _markdown(rows: list[list[Any]], columns: list[str]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it); cells on one line, pipes escaped."""

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "\u21b5")

    return "\n".join(
        [
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows),
        ]
    )


class _TensorBoard:
    def __init__(self, log_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None  # hides events past the resume point
        self.writer = SummaryWriter(str(log_dir), purge_step=purge, flush_secs=10)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One event holding every scalar of the step (``add_scalar`` writes one event per key: in a
        run whose trainer shares the driver's process, ~25 ms a step of the writer's GIL time)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        self.writer.file_writer.add_summary(Summary(value=values), step)

    def log_table(self, step: int, name: str, rows: list[list[Any]], columns: list[str]) -> None:
        self.writer.add_text(name, _markdown(rows, columns), step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(
        self,
        run_dir: Path,
        project: str,
        run_name: str | None,
        config: dict[str, Any] | None,
        resume_step: int | None,
        mode: str | None,
    ) -> None:
        import wandb

        # keep one wandb run id per run_dir so a resumed run continues the same wandb run
        id_file = run_dir / "wandb_run_id"
        resuming = resume_step is not None and id_file.exists()
        run_id = id_file.read_text().strip() if resuming else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=mode,
            reinit="finish_previous",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, name: str, rows: list[list[Any]], columns: list[str]) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class _ClearML:
    def __init__(self, project: str, run_name: str | None, config: dict[str, Any] | None) -> None:
        try:
            from clearml import Task
        except ImportError:
            raise MetricsError(
                "metrics backend 'clearml' is enabled but the clearml package is not installed; "
                "`pip install clearml` or remove 'clearml' from metrics.backends"
            ) from None
        self.task = Task.init(project_name=project, task_name=run_name or "relax", reuse_last_task_id=False)
        if config:
            self.task.connect(config)
        self.logger = self.task.get_logger()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            title, _, series = k.rpartition("/")
            self.logger.report_scalar(title or k, series or k, v, iteration=step)

    def close(self) -> None:
        self.task.close()


class MetricsLogger:
    """Fan-out logger. ``resume_step`` keeps history up to that step and drops what came after.

    ``wandb_mode`` ("online" | "offline" | "disabled") overrides ``WANDB_MODE``; wandb files go
    under ``run_dir/wandb``, TensorBoard events under ``run_dir/tensorboard``.
    """

    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[str] = ("console",),
        console_keys: Sequence[str] | None = None,
        project: str = "relax",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        resume_step: int | None = None,
        wandb_mode: str | None = None,
        stream: TextIO | None = None,
    ) -> None:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise MetricsError(f"unknown metrics backend(s) {unknown}; allowed: {list(BACKENDS)}")
        self.run_dir = Path(run_dir)
        with disk_guard("metrics", self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._sinks: list[Any] = [_Jsonl(self.jsonl_path, resume_step)]
        try:
            for b in dict.fromkeys(backends):
                if b == "console":
                    self._sinks.append(_Console(console_keys, stream or sys.stdout))
                elif b == "tensorboard":
                    self._sinks.append(_TensorBoard(self.run_dir / "tensorboard", resume_step))
                elif b == "wandb":
                    self._sinks.append(
                        _Wandb(self.run_dir, project, run_name, config, resume_step, wandb_mode)
                    )
                elif b == "clearml":
                    self._sinks.append(_ClearML(project, run_name, config))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Log one step; values must be real numbers (numpy/torch scalars are converted)."""
        clean: dict[str, float] = {}
        for k, v in metrics.items():
            try:
                clean[k] = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"metric {k!r} at step {step} is not a number: {v!r}") from None
        for sink in self._sinks:
            sink.log(step, clean)

    def log_table(self, step: int, name: str, rows: list[list[Any]], columns: list[str]) -> None:
        """Rows of text and numbers (sampled completions) to the backends that show tables: a W&B table,
        TensorBoard text; the others keep what the caller writes itself (``samples.jsonl``)."""
        for sink in self._sinks:
            if hasattr(sink, "log_table"):
                sink.log_table(step, name, rows, columns)

    def close(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def notify(url: str, event: str, payload: dict[str, Any] | None = None, timeout_s: float = 5.0) -> bool:
    """POST ``{"event": event, **payload}`` as JSON to a webhook; True on a 2xx answer.

    Notifications must never break a run, so every failure is logged and reported as False.
    """
    import requests

    body = {"event": event, **(payload or {})}
    try:
        resp = requests.post(url, json=body, timeout=timeout_s)
    except requests.RequestException as e:
        log.warning("notification %r to %s failed: %s", event, url, e)
        return False
    if not resp.ok:
        log.warning("notification %r to %s answered HTTP %s", event, url, resp.status_code)
    return resp.ok
