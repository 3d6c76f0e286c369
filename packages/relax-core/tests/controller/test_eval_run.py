"""Evaluation inside a run (every role in the driver, as the quick-start places them): schedule, metrics
rows, completion files, sets that fail while training goes on, the sample log, resume, and ``relax eval``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.hosting import in_driver
from relax.core.controller.run import run
from relax.core.plugins import Registration, get_plugin_manager

SMALL = [
    "rollout.prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "data.task_size=200",
    "data.task_heldout=6",
    "logging.progress=false",
    "logging.console=false",
    "logging.plot=true",
    "logging.log_samples=2",
    "checkpoint.save_every=0",
    "checkpoint.resume=auto",
    "eval.every_n_steps=2",
]
NEVER = threading.Event()


class _Raises:
    def score(self, sample):
        raise RuntimeError("judge unreachable")


class _Hangs:
    def score(self, sample):
        NEVER.wait()


@pytest.fixture(scope="module")
def eval_rewards():
    """Two rewards that fail in eval: one raises, one never returns (both scored in the driver)."""
    table = get_plugin_manager().registry._entries["reward"]
    added = {"eval_raises": _Raises, "eval_hangs": _Hangs}
    for name, cls in added.items():
        table[name] = Registration(
            "reward", name, lambda params, ctx, cls=cls: cls(), "eval-test", in_driver=True
        )
    yield
    for name in added:
        table.pop(name, None)


class _StatusObserver:
    """The run handle's metrics after step 3, which evaluates nothing (what the control plane's status serves)."""

    handle = None
    metrics: dict = {}

    def relax_on_run_start(self, run):
        self.handle = run

    def relax_on_step_end(self, step, metrics):
        if step == 3:
            self.metrics = dict(self.handle.metrics)


def _sets(tmp: Path) -> list[str]:
    (tmp / "empty.jsonl").write_text("\n")
    return [
        "eval.sets.heldout.path=null",
        "eval.sets.sampled.path=null",
        "eval.sets.sampled.n_samples=4",
        "eval.sets.sampled.temperature=1.0",
        "eval.sets.sampled.max_prompts=3",
        "eval.sets.broken.path=null",
        "eval.sets.broken.reward.name=eval_raises",
        "eval.sets.stuck.path=null",
        "eval.sets.stuck.reward.name=eval_hangs",
        "eval.sets.stuck.reward.timeout_s=0.5",
        f"eval.sets.gone.path={tmp / 'gone.jsonl'}",
        f"eval.sets.empty.path={tmp / 'empty.jsonl'}",
    ]


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, eval_rewards):
    """4 steps with six eval sets (two good, four failing), then resumed to 6 steps."""
    run_dir = tmp_path_factory.mktemp("eval-run")
    cfg = load_config(None, [*SMALL, "total_steps=4", f"run_dir={run_dir}", *_sets(run_dir)])
    assert in_driver(cfg)
    seen = _StatusObserver()
    get_plugin_manager().pm.register(seen, name="eval-status-observer")
    try:
        run(cfg)
    finally:
        get_plugin_manager().pm.unregister(seen)
    first = _rows(run_dir)
    at_2 = next(r for r in first if r["step"] == 2)
    assert (
        seen.metrics["step"] == 3 and "eval/heldout/accuracy" not in first[3]
    )  # step 3's own row has none, but
    assert (
        seen.metrics["eval/heldout/accuracy"] == at_2["eval/heldout/accuracy"]
    )  # the status keeps step 2's result
    run(load_config(None, [*SMALL, "total_steps=6", f"run_dir={run_dir}", *_sets(run_dir)]))
    return run_dir, first


def test_evaluates_before_training_every_n_steps_and_once_at_the_end(trained):
    run_dir, first = trained
    assert [r["step"] for r in first] == [0, 1, 2, 3, 4]
    evaluated = [r["step"] for r in first if "eval/heldout/accuracy" in r]
    assert evaluated == [0, 2, 4]
    assert all("reward/mean" in r for r in first[1:])  # the training steps were logged in full
    at_4 = first[-1]
    assert (
        at_4["eval/heldout/prompts"] == 6
        and at_4["eval/heldout/samples"] == 6
        and at_4["eval/heldout/version"] == 4
    )
    assert at_4["eval/sampled/prompts"] == 3 and at_4["eval/sampled/samples"] == 12
    assert {"eval/sampled/pass@4", "eval/sampled/mean@4", "eval/sampled/pass@2"} <= set(at_4)
    assert 0 <= at_4["eval/sampled/pass@1"] <= at_4["eval/sampled/pass@2"] <= at_4["eval/sampled/pass@4"] <= 1
    assert at_4["time/eval_s"] > 0


def test_failing_sets_are_marked_with_their_reason_and_training_goes_on(trained):
    run_dir, first = trained
    for step in (0, 2, 4):
        row = next(r for r in first if r["step"] == step)
        assert {row[f"eval/{name}/failed"] for name in ("broken", "stuck", "gone", "empty")} == {1.0}
        assert row["eval/heldout/failed"] == 0.0
    names = ("broken", "stuck", "gone", "empty")
    reasons = {name: (run_dir / "eval" / name / "step_2.failed.txt").read_text() for name in names}
    assert "judge unreachable" in reasons["broken"]
    assert "timed out" in reasons["stuck"]
    assert "gone.jsonl" in reasons["gone"] and "no such file" in reasons["gone"]
    assert "no usable prompts" in reasons["empty"]


def test_completions_on_disk_are_the_greedy_answers_of_the_saved_model(trained):
    """Step 6's greedy completions are what an independent ``transformers`` ``generate`` writes with final_hf."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = trained
    rows = _rows(run_dir / "eval" / "heldout", "step_6.jsonl")
    assert len(rows) == 6 and {(r["version"], r["min_version"], r["max_version"]) for r in rows} == {
        (6, 6, 6)
    }
    model_dir = run_dir / "final_hf"
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    for r in rows:
        ids = tok(r["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(
            ids,
            max_new_tokens=3,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == r["response"]
        assert r["score"] == float(r["response"].strip().startswith(r["label"]) and r["answer"] == r["label"])


def test_resume_keeps_the_schedule_without_duplicating_results(trained):
    run_dir, _ = trained
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval/heldout/accuracy" in r] == [0, 2, 4, 6]
    results = _rows(run_dir / "eval", "results.jsonl")
    keys = [(r["step"], r["set"]) for r in results]
    assert len(keys) == len(set(keys)) == 4 * 6
    assert {r["status"] for r in results if r["set"] in ("heldout", "sampled")} == {"ok"}


def test_log_samples_writes_k_rows_per_step_with_reward_and_advantage(trained):
    run_dir, _ = trained
    rows = _rows(run_dir, "samples.jsonl")
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert all(isinstance(r["advantage"], float) and r["prompt"].endswith("assistant\n") for r in rows)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]
    assert "eval/heldout/accuracy" in events.Tags()["scalars"]


def test_relax_eval_on_the_saved_model_prints_a_table(trained, capsys):
    from relax.core.cli import main

    run_dir, _ = trained
    last = _rows(run_dir)[-1]
    out = run_dir / "relax-eval"
    args = [f"run_dir={run_dir}", *[a for a in SMALL if a.startswith("data.")], "eval.sets.heldout.path=null"]
    assert main(["eval", *args, "--model", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("heldout ") and f"accuracy {last['eval/heldout/accuracy']:.4g}" in printed
    assert (
        len(_rows(out / "eval" / "heldout", "step_6.jsonl")) == 6
    )  # the run's last checkpoint step names the file
    # a checkpoint is converted first and evaluates the same
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert main(["eval", *args, "--model", str(ckpt), "--out", str(out / "ckpt")]) == 0
    assert f"accuracy {last['eval/heldout/accuracy']:.4g}" in capsys.readouterr().out


def test_relax_eval_names_bad_input(trained, tmp_path, capsys):
    from relax.core.cli import main

    run_dir, _ = trained
    base = [f"run_dir={tmp_path}", "data.task_heldout=6", "eval.sets.heldout.path=null"]
    assert main(["eval", *base, "--model", str(tmp_path / "nope")]) == 2
    assert "--model" in capsys.readouterr().err
    assert (
        main(["eval", *base, "eval.sets.heldout.reward.name=nope", "--model", str(run_dir / "final_hf")]) == 2
    )
    assert "eval.sets.heldout.reward.name: unknown reward 'nope'" in capsys.readouterr().err
    assert main(["eval", f"run_dir={tmp_path}", f"eval.sets.x.path={tmp_path / 'missing.jsonl'}"]) == 2
    assert "eval.sets.x.path" in capsys.readouterr().err
    assert (
        main(["validate", f"run_dir={tmp_path}", "eval.sets.x.path=null"]) == 2
    )  # no held-out split to take
    assert "eval.sets.x.path: null means the quick-start task's held-out split" in capsys.readouterr().err


def test_relax_eval_exits_1_naming_a_failed_set(trained, tmp_path, capsys, eval_rewards):
    from relax.core.cli import main

    run_dir, _ = trained
    args = [
        f"run_dir={tmp_path}",
        "data.task_heldout=6",
        "eval.sets.broken.path=null",
        "eval.sets.broken.reward.name=eval_raises",
    ]
    assert main(["eval", *args, "--model", str(run_dir / "final_hf")]) == 1
    captured = capsys.readouterr()
    assert "broken           FAILED" in captured.out and "judge unreachable" in captured.err
