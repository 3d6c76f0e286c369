"""``genrm``: LLM-as-judge. A judge model, served by any registered rollout engine in a Ray actor of
its own, reads a prompt built from ``template`` and its verdict is parsed into a score.

The template's ``{question}`` (``metadata[question_key]`` or the sample's prompt), ``{reference}``
(the label) and ``{response}`` (after ``</think>``) are substituted literally, so other braces in it
stay as they are. Parsers: ``token`` (the verdict's first word is ``positive`` -> 1, ``negative`` ->
0), ``score`` (the first number, which must lie in ``[score_min, score_max]``, scaled to [0, 1]),
``json`` (``json_field`` of the first JSON object, scaled the same way). An unparsable verdict or a
judge failure raises: the hub counts it and scores the fallback; it never stops the run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from relax.rewards.answers import after_think

DEFAULT_TEMPLATE = (
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
    "Is the response correct? Answer yes or no."
)


@dataclass(frozen=True)
class GenRMParams:
    """``reward.params`` of ``genrm``."""

    model_path: str = ""  # the judge: any local HF-format directory the engine can serve
    engine: str = "hf"  # registered rollout engine that serves it
    engine_params: dict[str, Any] = field(default_factory=dict)  # typed by that engine's registered config
    template: str = DEFAULT_TEMPLATE
    apply_chat_template: bool = True
    question_key: str = "question"  # metadata key with the raw question (else the sample's prompt)
    parser: Literal["token", "score", "json"] = "token"
    positive: str = "yes"
    negative: str = "no"
    score_min: float = 0.0
    score_max: float = 10.0
    json_field: str = "score"
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    num_cpus: float = 1.0  # reserved for the judge actor

    def validate(self) -> list[str]:
        errors = [] if self.model_path else ["model_path: the judge model directory is required"]
        if not self.score_max > self.score_min:
            errors.append(f"score_max: must be > score_min, got {self.score_max} <= {self.score_min}")
        if self.max_new_tokens < 1:
            errors.append(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.engine_params:
            from relax.core.config import build_section
            from relax.core.plugins import UnknownNameError, get_plugin_manager

            try:
                reg = get_plugin_manager().registration("rollout_engine", self.engine)
                build_section(reg.config, self.engine_params, "engine_params", errors)
            except UnknownNameError as e:
                errors.append(f"engine: {e}")
        return errors


class VerdictError(ValueError):
    """The judge's output does not contain a verdict the parser understands."""


def render(template: str, question: str, reference: str, response: str) -> str:
    return (
        template.replace("{question}", question)
        .replace("{reference}", reference)
        .replace("{response}", response)
    )


def _scaled(value: float, params: GenRMParams, text: str) -> float:
    if not params.score_min <= value <= params.score_max:
        raise VerdictError(
            f"judge score {value:g} outside [{params.score_min:g}, {params.score_max:g}] in {text[:120]!r}"
        )
    return (value - params.score_min) / (params.score_max - params.score_min)


def parse_verdict(text: str, params: GenRMParams) -> float:
    """The judge output as a score in [0, 1], or VerdictError."""
    body = (after_think(text) or "").strip()
    if params.parser == "token":
        words = re.findall(r"[^\W_]+", body.lower())
        if words and words[0] == params.positive.lower():
            return 1.0
        if words and words[0] == params.negative.lower():
            return 0.0
        raise VerdictError(
            f"judge verdict is neither {params.positive!r} nor {params.negative!r}: {body[:120]!r}"
        )
    if params.parser == "score":
        m = re.search(r"[-+]?\d+(?:\.\d+)?", body)
        if m is None:
            raise VerdictError(f"judge output has no number: {body[:120]!r}")
        return _scaled(float(m.group()), params, body)
    start, seen = body.find("{"), False
    while start >= 0:
        try:
            obj, _ = json.JSONDecoder().raw_decode(body[start:])
        except ValueError:
            obj = None
        seen = seen or isinstance(obj, dict)
        if isinstance(obj, dict) and params.json_field in obj:  # the first object carrying the field
            value = obj[params.json_field]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise VerdictError(f"judge JSON has no numeric {params.json_field!r}: {obj!r:.120}")
            return _scaled(float(value), params, body)
        start = body.find("{", start + 1)
    if seen:
        raise VerdictError(f"judge JSON has no numeric {params.json_field!r}: {body[:120]!r}")
    raise VerdictError(f"judge output has no JSON object: {body[:120]!r}")


class JudgeServer:
    """The judge engine plus its tokenizer, in a Ray actor: prompts in, texts out."""

    def __init__(self, engine: str, engine_params: dict[str, Any], model_path: str) -> None:
        from transformers import AutoTokenizer

        from relax.core.config import build_section
        from relax.core.context import PluginContext
        from relax.core.plugins import get_plugin_manager

        reg = get_plugin_manager().registration("rollout_engine", engine)
        errors: list[str] = []
        typed = build_section(reg.config, engine_params, "engine_params", errors)
        if errors:
            raise ValueError("genrm: " + "; ".join(errors))
        self.engine = reg.factory(
            typed, PluginContext(role="rollout", model_path=model_path, tokenizer_path=model_path)
        )
        self.tok = AutoTokenizer.from_pretrained(model_path)

    async def judge(
        self, prompts: list[str], chat: bool, max_new_tokens: int, temperature: float
    ) -> list[str]:
        from relax.core.protocols import GenerationRequest, SamplingParams

        eos = tuple(i for i in {self.tok.eos_token_id} if i is not None)
        params = SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=eos, seed=0
        )
        requests = []
        for i, prompt in enumerate(prompts):
            if chat and self.tok.chat_template:
                ids = self.tok.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            else:
                ids = self.tok(prompt)["input_ids"]
            requests.append(GenerationRequest(request_id=f"judge-{i}", prompt_ids=list(ids), params=params))
        results = await self.engine.generate(requests)
        by_id = {r.request_id: r for r in results}
        return [self.tok.decode(by_id[q.request_id].response_ids, skip_special_tokens=True) for q in requests]


class GenRMReward:
    """Inline in the hub: the work happens in the judge actor."""

    isolation = "inline"

    def __init__(self, params: GenRMParams, ctx: Any = None) -> None:
        import ray

        errors = params.validate()
        if errors:
            raise ValueError("genrm: " + "; ".join(errors))
        self.params = params
        self.judge = (
            ray.remote(JudgeServer)
            .options(num_cpus=params.num_cpus)
            .remote(params.engine, dict(params.engine_params), params.model_path)
        )

    def prompt_of(self, sample: Any) -> str:
        p = self.params
        question = str((sample.metadata or {}).get(p.question_key) or sample.prompt_text)
        response = after_think(sample.response_text) or ""
        return render(p.template, question, "" if sample.label is None else str(sample.label), response)

    async def verdicts(self, samples: list[Any]) -> list[str]:
        p = self.params
        return await self.judge.judge.remote(
            [self.prompt_of(s) for s in samples], p.apply_chat_template, p.max_new_tokens, p.temperature
        )

    async def score_group(self, samples: list[Any]) -> list[dict[str, float]]:
        """One result per sample; an unparsable verdict is returned as its VerdictError, which the hub
        counts for that sample alone."""
        out: list[Any] = []
        for text in await self.verdicts(samples):
            try:
                out.append({"score": parse_verdict(text, self.params)})
            except VerdictError as e:
                out.append(e)
        return out

    async def score(self, sample: Any) -> dict[str, float]:
        value = (await self.score_group([sample]))[0]
        if isinstance(value, Exception):
            raise value
        return value

    def close(self) -> None:
        import ray

        ray.kill(self.judge)
