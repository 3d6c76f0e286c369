"""The TRL arm of ``bench/vs_trl.py``: a ``GRPOTrainer`` run with the matched settings that file lists,
run in its own subprocess (``vs_trl.py --worker trl``) so its seconds include imports and model loading."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def trl_worker(
    task: Any, seed: int, max_steps: int, out: str, target: float, window: int, task_size: int
) -> None:
    """One TRL run of ``task`` (a ``vs_trl.Task``) in this process; events appended to ``out`` as JSON lines."""

    def write(**event) -> None:
        with open(out, "a") as f:
            f.write(json.dumps({"t": time.time(), **event}) + "\n")

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relax.core.quickstart_model import ensure_quickstart_model
    from relax.core.rewards.numeric import extract_number
    from relax.core.tasks.arithmetic import arithmetic_rows

    if task.chars:  # raw prompts (the tokenizer has no chat template)
        from vs_trl_chars import chars_rows, ensure_chars_model

        path, rows = ensure_chars_model(), chars_rows(task_size, seed)
        data = Dataset.from_list(rows)
    else:
        path, rows = ensure_quickstart_model(), arithmetic_rows(task_size, seed=seed)
        data = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows]
        )
    rewards: list[float] = []

    if task.plugin_reward:
        from vs_trl_reward import first_integer_matches as matches
    else:

        def matches(text: str, y: object) -> float:
            return float(extract_number(text, "first") == float(y))

    def numeric_reward(prompts, completions, label, **_):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        scores = [matches(t, y) for t, y in zip(texts, label, strict=True)]
        rewards.append(sum(scores) / len(scores))
        return scores

    class Timer(TrainerCallback):
        """A step's event is written at the log that follows it (TRL logs each generation's entropy after
        ``on_step_end``), or at the end of training."""

        pending: dict | None = None

        def on_train_begin(self, args, state, control, **kw):
            write(event="train_start")
            self.last = time.time()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % task.updates:
                return
            now = time.time()
            step = state.global_step // task.updates
            self.pending, self.last = (
                dict(event="step", step=step, reward=rewards[step - 1], step_s=now - self.last),
                now,
            )
            if len(rewards) >= window and sum(rewards[step - window : step]) / window >= target:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            if self.pending is not None:
                write(**self.pending, entropy=(logs or {}).get("entropy"))
                self.pending = None

        def on_train_end(self, args, state, control, **kw):
            self.on_log(args, state, control)

    args = GRPOConfig(
        output_dir=str(Path(out).parent / f"trl_{seed}"),  # nothing is saved there (save_strategy=no)
        seed=seed,
        use_cpu=True,
        bf16=False,
        num_generations=task.group,
        per_device_train_batch_size=task.prompts * task.group // task.updates,
        steps_per_generation=task.updates,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=task.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=task.clip_high,
        entropy_coef=task.entropy_coef,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=True,
        max_steps=max_steps * task.updates,
        logging_steps=task.updates,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype="float32"),
        reward_funcs=numeric_reward,
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
        callbacks=[Timer()],
    )
    trainer.train()


# --------------------------------------------------------------------------- driver
