"""``genrm``: verdict parsers on fixed judge outputs, the template, and a tiny local judge served by
the HF engine in its own Ray actor (protocol: the judge sees the rendered template and answers as
the engine would)."""

from __future__ import annotations

import asyncio
import re

import pytest

from relax.rewards.genrm import GenRMParams, GenRMReward, VerdictError, parse_verdict, render
from relax.rewards.testing import make_sample

TOKEN, SCORE, JSON = GenRMParams(), GenRMParams(parser="score"), GenRMParams(parser="json", score_max=1.0)


@pytest.mark.parametrize(
    ("text", "params", "expected"),
    [
        ("Yes, it is correct.", TOKEN, 1.0),
        ("no.", TOKEN, 0.0),
        ("<think>hmm, no</think> yes", TOKEN, 1.0),
        ("**YES**", TOKEN, 1.0),
        ("Score: 7/10", SCORE, 0.7),
        ("10", SCORE, 1.0),
        ("I'd say 0.", SCORE, 0.0),
        ('Verdict: {"score": 0.25, "why": "partly"}', JSON, 0.25),
        ('{"score": 1}', JSON, 1.0),
        ('{"x": {} } then {"score": 0.5}', JSON, 0.5),
    ],
)
def test_parsers_on_fixed_judge_outputs(text, params, expected):
    assert parse_verdict(text, params) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "params", "match"),
    [
        ("Maybe.", TOKEN, "neither 'yes' nor 'no'"),
        ("", TOKEN, "neither"),
        ("Score: 11", SCORE, "outside"),
        ("no number", SCORE, "no number"),
        ('{"score": "high"}', JSON, "no numeric 'score'"),
        ('{"score": true}', JSON, "no numeric"),
        ("{broken", JSON, "no JSON object"),
        ('{"score": 2}', JSON, "outside"),
    ],
)
def test_unparsable_verdicts_raise(text, params, match):
    with pytest.raises(VerdictError, match=match):
        parse_verdict(text, params)


def test_template_substitutes_literally_and_params_validate():
    assert (
        render('{"q": "{question}"} {reference}/{response} {other}', "Q?", "R", "A")
        == '{"q": "Q?"} R/A {other}'
    )
    assert GenRMParams().validate() == ["model_path: the judge model directory is required"]
    errors = GenRMParams(model_path="m", engine_params={"max_batch_size": "big"}).validate()
    assert errors == ["engine_params.max_batch_size: expected int, got str 'big'"]


def test_tiny_judge_through_the_hf_engine(ray_session, tmp_path_factory):
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.protocols import GenerationRequest, SamplingParams
    from relax.core.testing import tiny_model_dir
    from relax.rewards.hub import Hub, HubParams

    model = tiny_model_dir(tmp_path_factory.mktemp("judge"))
    template = "{question}={reference}? {response}"
    params = GenRMParams(
        model_path=model, template=template, max_new_tokens=6, num_cpus=0, engine_params={"max_batch_size": 4}
    )
    judge = GenRMReward(params)
    samples = [
        make_sample("7", "7", {"question": "3+4"}, index=0),
        make_sample("<think>x</think>9", "7", {"question": "3+4"}, index=1),
    ]
    assert judge.prompt_of(samples[1]) == "3+4=7? 9"  # think stripped, fields substituted
    texts = asyncio.run(judge.verdicts(samples))

    # the same prompts through the same engine in this process: the actor served exactly this
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    engine = HFRolloutEngine(model, max_batch_size=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,), seed=0)
    requests = [
        GenerationRequest(
            f"r{i}",
            tok.apply_chat_template(
                [{"role": "user", "content": judge.prompt_of(s)}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"],
            sp,
        )
        for i, s in enumerate(samples)
    ]
    direct = asyncio.run(engine.generate(requests))
    assert texts == [tok.decode(r.response_ids, skip_special_tokens=True) for r in direct]

    # parse what the judge said: accept its first word as the positive verdict, so the path to 1.0 runs
    words = re.findall(r"[^\W_]+", texts[0].lower())
    positive = words[0] if words else "yes"
    hub = Hub(
        HubParams(
            routes={
                "j": {
                    "name": "genrm",
                    "params": {**params.__dict__, "positive": positive, "negative": "never-said"},
                }
            },
            default="j",
        )
    )
    out = asyncio.run(hub.score_group(samples))
    for text, o in zip(texts, out, strict=True):
        first = (re.findall(r"[^\W_]+", text.lower()) or [None])[0]
        if first == positive:
            assert o["score"] == 1.0 and o["genrm/failed"] == 0.0
        else:  # unparsable: counted, fallback, the run goes on
            assert o == {**o, "score": 0.0, "genrm/failed": 1.0, "reward_failed": 1.0}
    assert hub.pool is None
    hub.close()
    judge.close()
