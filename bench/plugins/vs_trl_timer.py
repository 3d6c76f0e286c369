"""Relax side of ``bench/vs_trl.py``: appends one JSON line per event to ``$VS_TRL_OUT`` (wall clock).

Loaded with ``RELAX_PLUGINS=vs_trl_timer``: ``train_start`` when the first step is about to run
(every role up, weights synced), then each step's mean reward (and the policy's mean token entropy) as the step ends.
"""

from __future__ import annotations

import json
import os
import time

from relax.core.hookspecs import hookimpl


def _write(**event) -> None:
    with open(os.environ["VS_TRL_OUT"], "a") as f:
        f.write(json.dumps({"t": time.time(), **event}) + "\n")


@hookimpl
def relax_on_run_start(run) -> None:
    if threads := os.environ.get("VS_TRL_THREADS"):  # bench/vs_trl.py --threads: the driver took every core
        import torch

        torch.set_num_threads(int(threads))
    _write(event="train_start")


@hookimpl
def relax_on_step_end(step, metrics) -> None:
    _write(
        event="step",
        step=step,
        reward=metrics["reward/mean"],
        step_s=metrics["time/step_s"],
        entropy=metrics.get("train/entropy"),
    )
