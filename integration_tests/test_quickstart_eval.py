"""The quick-start's held-out eval (examples/quickstart_eval.yaml): greedy accuracy on sums never trained on
rises from < 0.3 to >= 0.8, and the final greedy eval is what an independent ``transformers`` ``generate`` pass answers on the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config
from relax.core.controller.run import run
from relax.core.rewards.numeric import extract_number

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart_eval.yaml"
STEPS = 100  # as the quick-start learning test: seeds reach reward 0.8 in 36-58 steps here


def test_quickstart_heldout_accuracy_rises_and_matches_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(
        EXAMPLE,
        [
            f"total_steps={STEPS}",
            f"run_dir={tmp_path}",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "checkpoint.save_every=0",
        ],
    )
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["eval/heldout/accuracy"] for r in rows if "eval/heldout/accuracy" in r}
    assert sorted(curve) == [0, 20, 40, 60, 80, 100]
    assert curve[0] < 0.3 and curve[STEPS] >= 0.8, f"held-out greedy accuracy by step: {curve}"
    assert (tmp_path / "curves.png").stat().st_size > 0

    heldout = [
        json.loads(line)
        for line in (tmp_path / "eval" / "heldout" / f"step_{STEPS}.jsonl").read_text().splitlines()
    ]
    train_file = tmp_path / "data" / "arithmetic_train_h10.jsonl"
    train_prompts = {json.loads(line)["prompt"] for line in train_file.read_text().splitlines()}
    asked = [
        r["prompt"].split("user\n")[1].split("<|im_end|>")[0] for r in heldout
    ]  # "3+5=" inside the chat template
    assert len(heldout) == 10 and not set(asked) & train_prompts
    model_dir = tmp_path / "final_hf"
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    correct = 0
    for r in heldout:
        ids = tok(r["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=3,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert answer == r["response"], (
            r["prompt"],
            answer,
            r["response"],
        )  # the same answers, token for token
        correct += extract_number(answer) == float(r["label"])
    assert correct / len(heldout) == curve[STEPS]
