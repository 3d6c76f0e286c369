"""The agent quick-start's pieces agree with the environment and core's token bookkeeping (fast, no training)."""

from __future__ import annotations

import json

import pytest

from relax.agents.quickstart.model import build_tokenizer
from relax.agents.quickstart.task import problem_rows, tool_call_text, write_rows
from relax.agents.quickstart.warmup import WarmupConfig, decision_share, transcript
from relax.core.agentic import ObservationRenderer
from relax.core.data import Sample
from relax.core.protocols import Turn


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_the_call_is_short_and_decodes_to_itself(tokenizer):
    text = tool_call_text("123*456")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert len(ids) <= 36  # whole tokens for the markers and JSON keys, not ~80 characters
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # the call markers are ordinary tokens: a rollout's decoded text keeps them for the parser
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_the_tools_environment_answers_the_call_with_the_label():
    """The format the warm-up teaches is what the ``hermes`` parser and ``tools`` environment read."""
    from relax.agents.config import ToolsEnvParams
    from relax.agents.parsers import HermesParser
    from relax.agents.tools_env import ToolsEnvironment

    row = problem_rows(1, seed=7)[0]
    content, calls = HermesParser().parse(tool_call_text(row["prompt"].rstrip("=")))
    assert content == "" and [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": row["prompt"].rstrip("=")}, "")
    ]
    episode = ToolsEnvironment(ToolsEnvParams(tools=["calculator"], answer="numeric")).start(
        Sample(prompt_ids=[], group_id=0, label=row["label"])
    )
    observed = episode.step(Turn(0, "", [], calls, "stop"))
    assert observed.observations == [{"role": "tool", "content": row["label"]}] and not observed.done
    assert episode.step(Turn(1, row["label"], [], [], "stop", row["label"])).reward == 1.0
    assert episode.step(Turn(1, "12345", [], [], "stop", "12345")).reward == 0.0


def test_a_transcript_is_what_a_rollout_appends(tokenizer):
    renderer = ObservationRenderer(tokenizer)
    ids, mask = transcript(tokenizer, renderer, 123, 456, use_tool=True, guess=0)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    call_end = text.index("</tool_call>") + len("</tool_call><|im_end|>")
    assert text.endswith("<|im_start|>assistant\n56088<|im_end|>")
    # the observation is exactly core's continuation after the call's end-of-turn token
    observation = renderer.ids([{"role": "tool", "content": "56088"}], ended_with="<|im_end|>")
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    untrained_tail = [t for t, m in zip(ids, mask, strict=True) if not m][-len(observation) :]
    assert untrained_tail == observation
    assert (
        tokenizer.decode(trained, skip_special_tokens=False)
        == tool_call_text("123*456") + "<|im_end|>56088<|im_end|>"
    )
    assert (
        tokenizer.decode(
            ids[: len(tokenizer(text[:call_end], add_special_tokens=False)["input_ids"])],
            skip_special_tokens=False,
        )
        == text[:call_end]
    )
    # a direct answer trains only its (random) number; without the decision its first token is untrained
    ids, mask = transcript(tokenizer, renderer, 123, 456, use_tool=False, guess=31337)
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "31337<|im_end|>"
    _, undecided = transcript(
        tokenizer, renderer, 123, 456, use_tool=False, guess=31337, train_decision=False
    )
    assert sum(undecided) == sum(mask) - 1


@pytest.mark.parametrize(("fraction", "rate"), [(0.5, 0.15), (0.75, 0.1), (0.2, 0.5)])
def test_the_decision_share_gives_the_call_rate(fraction, rate):
    share = decision_share(WarmupConfig(tool_fraction=fraction, call_rate=rate))
    trained_calls, trained_direct = fraction * share, 1 - fraction
    assert 0 < share <= 1
    assert trained_calls / (trained_calls + trained_direct) == pytest.approx(min(rate, fraction))


def test_task_rows_are_products_out_of_guessing_range(tmp_path):
    rows = problem_rows(200, seed=0)
    assert rows == problem_rows(200, seed=0) and rows != problem_rows(200, seed=1)
    for row in rows:
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["label"] == str(a * b)
    assert len({r["label"] for r in rows}) > 190  # no answer a policy could learn to repeat
    path = write_rows(tmp_path / "d" / "train.jsonl", rows)
    assert [json.loads(line) for line in open(path)] == rows


def test_the_model_is_built_once_per_recipe(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.agents.quickstart import ensure_agent_model, recipe_fingerprint

    tiny = WarmupConfig(steps=2, batch_size=4)
    path = ensure_agent_model(tmp_path / "m", warmup=tiny)
    stamp = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    assert ensure_agent_model(tmp_path / "m", warmup=tiny) == path  # reused, not rebuilt
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == stamp
    recipe = json.loads((tmp_path / "m" / "relax_agent_quickstart.json").read_text())
    assert recipe["fingerprint"] == recipe_fingerprint(tiny) != recipe_fingerprint()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) and tokenizer.chat_template
    assert tokenizer.decode(tokenizer(tool_call_text("1*2"))["input_ids"]) == tool_call_text("1*2")
    other = WarmupConfig(steps=1, batch_size=4)
    ensure_agent_model(tmp_path / "m", warmup=other)  # another recipe: rebuilt in place
    assert json.loads((tmp_path / "m" / "relax_agent_quickstart.json").read_text())[
        "fingerprint"
    ] == recipe_fingerprint(other)


def test_relax_has_the_prepare_command():
    from relax.core.cli import build_parser

    ns = build_parser().parse_args(["agent-quickstart", "--model-dir", "m", "--data", "d.jsonl"])
    assert (ns.model_dir, ns.data) == ("m", "d.jsonl") and callable(ns.fn)


def test_the_warm_up_is_a_helper_any_task_can_call(tokenizer):
    """An environment author's own task (a ``lookup`` tool) warms a tiny model up with the same helper."""
    from relax.agents.quickstart.model import build_model
    from relax.agents.quickstart.warmup import conversation_transcript, supervised_warm_up

    renderer = ObservationRenderer(tokenizer)
    call = '<tool_call>{{"name": "lookup", "arguments": {{"key": "{}"}}}}</tool_call>'

    def example(rng):
        word = rng.choice(["relax", "agent", "tool"])
        turns = [call.format(word), [{"role": "tool", "content": word[::-1]}], word[::-1]]
        return conversation_transcript(
            tokenizer, renderer, [{"role": "user", "content": f"define {word}"}], turns
        )

    ids, mask = example(__import__("random").Random(0))
    assert (
        tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m]).count("<|im_start|>tool") == 1
    )
    losses = supervised_warm_up(build_model(tokenizer, seed=0), example, steps=25, batch_size=4, lr=6e-3)
    assert len(losses) == 25 and losses[-1] < losses[0] / 2  # it learns the format
