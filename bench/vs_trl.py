"""Relax vs Hugging Face TRL's ``GRPOTrainer``, side by side on this machine, on three tasks (``--task``):

- ``quickstart``: the quick-start (32 prompts x 8 samples a step, 4 updates of 64, core's ``numeric``
  reward);
- ``single``: what a user brings -- a reward from a plugin package (``bench/plugins/vs_trl_reward.py``,
  registered ``in_driver=True``; TRL calls the same function), larger groups (16 prompts x 16 samples)
  and one update of all 256 responses per step;
- ``chars``: ``single``'s settings on TRL's kind of synthetic task (``bench/plugins/vs_trl_chars.py``): a
  randomly initialised 790 k-parameter Qwen3 (HF init 0.02) with a character-level tokenizer (vocab 20,
  ``<eos>`` ends a response) and raw prompts ``"a+b="`` (no chat template; sums 0-18), at most 4 new
  tokens, clip 0.2 / 0.2, entropy bonus 0.02; hundreds of steps to the threshold (``--max-steps``).

Each run is a fresh subprocess (``relax run ...`` / this file with ``--worker trl``), so the
seconds from launch include imports, model loading and (for Relax) Ray start. Seeds are
interleaved (TRL then Relax for seed 0, Relax then TRL for seed 1, ...) so machine-speed drift hits
both alike. Time to reward is when the mean reward of the last 5 steps first reaches 0.8, a step
being one generation followed by its updates (TRL: ``steps_per_generation`` optimizer steps).
Per-step rewards of both are plotted to ``--out`` (``curves_<task>.png``, one line per run).

Matched settings (TRL field names in brackets; TRL 1.16's ``GRPOTrainer`` / ``GRPOConfig``):

- model and tokenizer: the quick-start's, built locally (``relax.core.quickstart_model``, cached
  under ``~/.cache/relax``); both load the same directory; nothing is downloaded; fp32 on CPU;
- rows: ``arithmetic_rows(2000, seed)`` ("3+4=" -> "7"), Relax writes the same rows itself
  (``data.task_size``; its data seed is the run seed);
- prompt string: the tokenizer's chat template with one user turn and the generation prompt,
  ``<|im_start|>user\\n3+4=<|im_end|>\\n<|im_start|>assistant\\n`` (TRL: a conversational dataset);
- reward rule: 1 if the first number in the response equals the label, else 0 (Relax's
  ``numeric`` reward; TRL calls ``relax.core.rewards.numeric.extract_number``, the same function);
- group size G [num_generations], prompts per step [generation_batch_size = prompts x G], updates
  per step [steps_per_generation; per_device_train_batch_size = prompts x G / updates,
  gradient_accumulation=1, num_iterations=1], as the task says; with several updates, old logprobs
  before the first (TRL computes them at generation since steps_per_generation >
  gradient_accumulation_steps; Relax fuses the first mini-batch's); with one update neither scores
  old logprobs (the ratio is 1 by construction: TRL detaches, Relax fuses);
- sampling: temperature 1, no top-k/top-p, at most 3 new tokens [max_completion_length], stop at
  ``<|im_end|>``;
- AdamW lr 5e-4 constant [lr_scheduler_type=constant], betas (0.9, 0.999), eps 1e-8, no weight
  decay, grad clip 1.0 [max_grad_norm];
- PPO clip 0.2 / 0.28 [epsilon, epsilon_high], entropy bonus 0.03 [entropy_coef], token-mean loss
  [loss_type=dapo: normalised by the mini-batch's response tokens], no KL [beta=0], GRPO group
  advantages scaled by the group std [scale_rewards=group];
- entropy bonus, same meaning in both: the mean over the mini-batch's response tokens of each token's
  full-vocabulary entropy at temperature 1, subtracted as ``coef x entropy`` from the loss (TRL 1.16:
  ``entropy_coef * (entropies * mask).sum() / mask.sum()``; Relax: ``agg_loss(entropy, mask,
  token-mean)``, the same token mean);
- group advantages ``(r - mean) / (std + eps)``, both with the Bessel-corrected std (TRL's ``nanstd``) and
  TRL's eps 1e-4 (Relax: ``algorithm.advantage_params.epsilon``; its default 1e-6 differs by < 0.04 % here);
- two intentional differences, both inert with one update per step (every ratio is exactly 1): TRL's ``dapo`` divides each mini-batch's policy loss by the
  *generation's* response tokens / updates, Relax's ``token-mean`` by the mini-batch's own (equal when
  lengths are, as nearly here: at most 3 tokens); Relax's ``ppo`` keeps verl's dual clip (a negative
  advantage's ratio capped at ``clip_ratio_c`` = 3; how often it binds is ``train/dual_clip_frac``), TRL has none;
- shuffling: both shuffle the prompts with the run seed (each its own sampler, so the order differs);
- Relax runs the quick-start's own execution settings: colocate, trainer, engine and reward in one
  process (``rollout.host: auto``, which is ``driver`` here: no Ray is started, as TRL starts none);
  ``--relax-mode async`` tries rollout and training overlapped, one step stale at most (Ray actors);
- no checkpoints during the run (TRL: save_strategy=no; Relax: checkpoint.save_every=0, no final HF
  save, no plot); Relax keeps its default console + metrics.jsonl + TensorBoard logging.

Checked equal, not just matched by name (``packages/relax-core/tests/policy_update/test_trl_parity.py``,
TRL's own code on one side): for one batch with EOS-stopped, truncated and all-equal-reward groups, TRL's
scoring + ``compute_loss`` and Relax's policy update give the same masks (each completion through its EOS,
truncated ones in full), advantages, loss, entropy and gradient, at ratio 1 and clipped; three updates
through TRL's ``train()`` (AdamW, clipping, LR) replayed into Relax's trainer give the same losses, gradient
norms and weights. What still differs by design: each side's own sampler RNG and prompt order (the same
rows, shuffled with the run seed by each), and Relax's torch threads in the driver (every core; TRL: torch's
default, the same here). On ``chars`` both sides plateau at 0.55-0.70 with the entropy climbing back (issue
44 saw it on Relax alone, one run each): a 5-step mean crossing 0.8 there is a fluctuation, so the mean
reward per step over the steps both ran is printed as well (docs/benchmarks-history.md). Relax's per-step
cost on CPU had grown by two full ``gc.collect`` per colocate step (trainer release), now only where CUDA runs.

    python bench/vs_trl.py [--task quickstart|single|chars] [--seeds 0,1,2] [--max-steps N] [--quick]
                           [--concurrent] [--threads N]

``--concurrent --threads 1`` runs a seed's two arms at once, one torch thread each: on a loaded machine the
learning-per-step numbers (steps to reward, mean reward per step) in a fraction of the time; the seconds then
measure two runs sharing the cores, not the bench's timings.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "plugins"))  # vs_trl_reward, vs_trl_chars: both arms import them
TARGET, WINDOW, TASK_SIZE = 0.8, 5, 2000


@dataclass(frozen=True)
class Task:
    prompts: int  # per step
    group: int  # samples per prompt
    updates: int  # optimizer steps per generation (mini-batches)
    max_steps: int  # a run gives up after this many steps
    plugin_reward: bool  # bench/plugins/vs_trl_reward.py's first_integer instead of core's numeric
    chars: bool = (
        False  # bench/plugins/vs_trl_chars.py's model and rows, raw prompts (else the quick-start's)
    )
    max_new_tokens: int = 3
    clip_high: float = 0.28
    entropy_coef: float = 0.03


TASKS = {
    "quickstart": Task(prompts=32, group=8, updates=4, max_steps=80, plugin_reward=False),
    "single": Task(prompts=16, group=16, updates=1, max_steps=200, plugin_reward=True),
    "chars": Task(
        prompts=16,
        group=16,
        updates=1,
        max_steps=2000,
        plugin_reward=True,
        chars=True,
        max_new_tokens=4,
        clip_high=0.2,
        entropy_coef=0.02,
    ),
}
#: Relax's execution mode for its arm (its own setting; every matched hyper-parameter stays as listed):
#: colocate takes turns, strictly on-policy; async overlaps rollout and training, one step stale at most
RELAX_MODES = {"colocate": [], "async": ["mode=async", "max_staleness=1"]}
ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
}


def crossing(steps: list[dict]) -> dict | None:
    """The first step whose trailing ``WINDOW``-step mean reward reaches ``TARGET``."""
    rewards = [s["reward"] for s in steps]
    for i in range(WINDOW - 1, len(steps)):
        if sum(rewards[i - WINDOW + 1 : i + 1]) / WINDOW >= TARGET:
            return steps[i]
    return None


def relax_task_overrides(task: Task, seed: int, workdir: Path) -> list[str]:
    """The quick-start config's fields that ``task`` changes (every other matched setting is its)."""
    chars = []
    if task.chars:  # the model and the rows the TRL arm uses (same seed), raw prompts
        from vs_trl_chars import ensure_chars_model, write_rows

        data = write_rows(workdir / f"chars_{seed}.jsonl", TASK_SIZE, seed)
        chars = [f"model.path={ensure_chars_model()}", f"data.path={data}", "data.apply_chat_template=false"]
    return [
        f"rollout.prompts_per_step={task.prompts}",
        f"rollout.n_samples_per_prompt={task.group}",
        f"trainer.num_minibatches={task.updates}",
        f"rollout.max_new_tokens={task.max_new_tokens}",
        f"algorithm.clip_ratio_high={task.clip_high}",
        f"algorithm.entropy_coef={task.entropy_coef}",
        "algorithm.advantage_params.epsilon=0.0001",
        *(["reward.name=first_integer"] if task.plugin_reward else []),
        *chars,
    ]


def launch(
    task_name: str,
    system: str,
    seed: int,
    max_steps: int,
    workdir: Path,
    relax_mode: str = "colocate",
    threads: int = 0,
) -> dict:
    """One run in a fresh process; returns its seconds to reward (None if it never got there) and its steps.
    ``threads``: torch threads of the run (0: each side's default; Relax's driver takes every core)."""
    task = TASKS[task_name]
    out = workdir / f"{system}_{seed}.jsonl"
    env = {**os.environ, **ENV, "VS_TRL_OUT": str(out)}
    if threads:  # TRL: torch reads OMP_NUM_THREADS; Relax: vs_trl_timer sets it once the roles are up
        env["OMP_NUM_THREADS"] = env["VS_TRL_THREADS"] = str(threads)
    if system == "relax":
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [str(HERE / "plugins"), env.get("PYTHONPATH", "")] if p
        )
        env["RELAX_PLUGINS"] = "vs_trl_timer" + (",vs_trl_reward" if task.plugin_reward else "")
        cmd = [
            sys.executable,
            "-m",
            "relax.core.cli",
            "run",
            str(ROOT / "examples" / "quickstart.yaml"),
            f"seed={seed}",
            f"run_dir={workdir / f'relax_{seed}'}",
            f"total_steps={max_steps}",
            "checkpoint.save_every=0",
            "checkpoint.save_hf_final=false",
            "logging.plot=false",
            "logging.progress=false",
            *relax_task_overrides(task, seed, workdir),
            *RELAX_MODES[relax_mode],
        ]
    else:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "trl",
            "--task",
            task_name,
            "--seed",
            str(seed),
            "--max-steps",
            str(max_steps),
        ]
    log = open(workdir / f"{system}_{seed}.log", "w")
    started = time.time()
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
    )
    hit = None
    while proc.poll() is None:  # Relax: stop the run (Ctrl-C) once it crossed; TRL stops itself
        time.sleep(0.5)
        events = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        hit = crossing([e for e in events if e["event"] == "step"])
        if hit is not None and system == "relax":
            proc.send_signal(signal.SIGINT)
            break
    proc.wait(timeout=300)
    log.close()
    events = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    steps = [e for e in events if e["event"] == "step"]
    begin = next((e["t"] for e in events if e["event"] == "train_start"), None)
    hit = crossing(steps)
    if begin is None or not steps:
        tail = (workdir / f"{system}_{seed}.log").read_text()[-2000:]
        raise RuntimeError(
            f"{system} seed {seed} produced no steps (exit {proc.returncode}); log tail:\n{tail}"
        )
    return {
        "system": system,
        "seed": seed,
        "start_s": begin - started,
        "step_s": sum(s["step_s"] for s in steps[1:]) / max(len(steps) - 1, 1),  # the first one warms up
        "steps": hit["step"] if hit else None,
        "launch_s": hit["t"] - started if hit else None,
        "train_s": hit["t"] - begin if hit else None,
        "rewards": [s["reward"] for s in steps],
        "entropies": [s.get("entropy") for s in steps],
    }


def mean_rewards(results: list[dict], seed: int) -> tuple[int, float, float]:
    """Steps both arms of ``seed`` ran, and TRL's and Relax's mean reward over them: learning per step without
    the threshold's noise (a 5-step mean first crossing 0.8 is a rare fluctuation where the curve plateaus)."""
    trl, relax = (
        next(r["rewards"] for r in results if r["seed"] == seed and r["system"] == s)
        for s in ("trl", "relax")
    )
    n = min(len(trl), len(relax))
    return n, sum(trl[:n]) / n, sum(relax[:n]) / n


def print_mean_rewards(results: list[dict], seeds: list[int]) -> None:
    rows = [mean_rewards(results, seed) for seed in seeds]
    for seed, (n, trl, relax) in zip(seeds, rows, strict=True):
        print(f"seed {seed}: mean reward over the {n} steps both ran: TRL {trl:.3f} | Relax {relax:.3f}")
    trl, relax = (sum(r[i] for r in rows) / len(rows) for i in (1, 2))
    print(
        f"mean over seeds {seeds}: TRL {trl:.3f} | Relax {relax:.3f} mean reward per step | ratio {relax / trl:.2f}x"
    )


def plot(results: list[dict], path: Path) -> None:
    """Per-step reward and entropy of every run (TRL dashed), so learning per step can be compared by eye."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_entropy) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        style = dict(linestyle="--" if r["system"] == "trl" else "-", color=f"C{r['seed']}", linewidth=1)
        ax.plot(
            range(1, len(r["rewards"]) + 1), r["rewards"], label=f"{r['system']} seed {r['seed']}", **style
        )
        steps = [(i, e) for i, e in enumerate(r["entropies"], 1) if e is not None]
        ax_entropy.plot([i for i, _ in steps], [e for _, e in steps], **style)
    ax.axhline(TARGET, color="grey", linewidth=0.5)
    ax.set(xlabel="step", ylabel="mean reward", title="reward per step: Relax (solid) vs TRL (dashed)")
    ax_entropy.set(xlabel="step", ylabel="mean token entropy", title="policy entropy per step")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (>= 3 for the headline)")
    parser.add_argument(
        "--task", choices=sorted(TASKS), default="quickstart", help="what both train (see above)"
    )
    parser.add_argument(
        "--max-steps", type=int, help="give up on a run after this many steps (default: the task's)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs" / "bench_vs_trl", help="where the curves go"
    )
    parser.add_argument("--quick", action="store_true", help="one seed, 60 steps: a smoke run, not a result")
    parser.add_argument(
        "--relax-mode",
        choices=sorted(RELAX_MODES),
        default="colocate",
        help="Relax's execution mode (colocate: faster here, see docs/benchmarks.md)",
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run a seed's two arms at the same time (steps to reward and mean reward per step "
        "still compare; seconds do not: the arms share the cores)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per run (0: each side's default)"
    )
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    task = TASKS[args.task]
    max_steps = args.max_steps or (min(60, task.max_steps) if args.quick else task.max_steps)
    if args.worker:
        from vs_trl_arm import trl_worker

        return trl_worker(task, args.seed, max_steps, os.environ["VS_TRL_OUT"], TARGET, WINDOW, TASK_SIZE)
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    from vs_trl_chars import ensure_chars_model

    from relax.core.quickstart_model import ensure_quickstart_model

    model = ensure_chars_model() if task.chars else ensure_quickstart_model()
    print(f"model: {model}  (built before the runs; both load it)", flush=True)
    print(f"task {args.task}: {task}", flush=True)
    print(f"relax: mode {args.relax_mode} {' '.join(RELAX_MODES[args.relax_mode])}".rstrip(), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        for i, seed in enumerate(seeds):
            order = ("trl", "relax") if i % 2 == 0 else ("relax", "trl")
            runs = [
                partial(launch, args.task, system, seed, max_steps, Path(tmp), args.relax_mode, args.threads)
                for system in order
            ]
            if (
                args.concurrent
            ):  # both arms at once: learning per step on a loaded machine (timings share the cores)
                with ThreadPoolExecutor(2) as pool:
                    seed_results = list(pool.map(lambda run: run(), runs))
            else:
                seed_results = [run() for run in runs]
            for system, r in zip(order, seed_results, strict=True):
                results.append(r)
                reached = (
                    f"reward {TARGET} at step {r['steps']}: {r['launch_s']:.1f} s from launch, "
                    f"{r['train_s']:.1f} s of training"
                    if r["steps"]
                    else f"no {TARGET} in {max_steps} steps"
                )
                print(
                    f"seed {seed} {system:<5} start {r['start_s']:5.1f} s | {r['step_s']:.3f} s/step | {reached}",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"runs_{args.task}.json").write_text(json.dumps(results))
    plot(results, args.out / f"curves_{args.task}.png")
    print(f"reward curves: {args.out / f'curves_{args.task}.png'}")
    print_mean_rewards(results, seeds)
    both = [s for s in seeds if all(r["steps"] for r in results if r["seed"] == s)]
    if not both:
        print(
            f"vs_trl: nanx time to reward {TARGET} (TRL / Relax) on task {args.task}: no seed reached it in both"
        )
        return
    total = {
        (sys_, key): sum(r[key] for r in results if r["system"] == sys_ and r["seed"] in both)
        for sys_ in ("trl", "relax")
        for key in ("launch_s", "train_s", "steps", "start_s", "step_s")
    }
    n = len(both)
    for key, what in (
        ("start_s", "s launch -> first step"),
        ("step_s", "s per step"),
        ("steps", "steps to reward"),
        ("train_s", "s of training to reward"),
        ("launch_s", "s from launch to reward"),
    ):
        f = ".3f" if key == "step_s" else ".1f"
        print(
            f"mean over seeds {both}: TRL {total['trl', key] / n:7{f}} | Relax {total['relax', key] / n:7{f}} {what}"
            f" | ratio {total['trl', key] / total['relax', key]:.2f}x"
        )
    print(
        f"vs_trl: {total['trl', 'launch_s'] / total['relax', 'launch_s']:.2f}x time to reward {TARGET} (TRL / Relax)"
        f", from launch, task {args.task}; {total['trl', 'train_s'] / total['relax', 'train_s']:.2f}x in training time"
        f"; {total['trl', 'steps'] / total['relax', 'steps']:.2f}x in steps"
    )


if __name__ == "__main__":
    main()
