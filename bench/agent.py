"""Multi-turn rollout throughput: the HF engine continuing each turn from its kept KV (prefix reuse) vs
re-prefilling the whole trajectory every turn, on the same model and the same episodes.

Episodes (``relax.core.agentic.Turns`` driven by ``relax.core.controller.router.stream_groups``, as a run
drives them): ``--prompts`` quick-start chat prompts x G=``--group``, ``--turns`` policy turns each of
exactly ``--turn-tokens`` sampled tokens (EOS ignored, so both sides do the same work), and after every
turn but the last the same tool observation of about ``--observation`` tokens (a deterministic
environment defined here). Each turn's request is the prompt plus the whole trajectory so far, as
``Turns`` builds it; with ``prefix_cache_mb`` the engine prefills only what follows the previous turn.

Both sides are engines over one shared model module (``HFRolloutEngine(model=...)``), one with the
prefix cache and one without; every round runs both on the same seeds, in alternating order, and
checks that they produced the same trajectories. The headline is the median of the per-round
wall-clock ratios (the ratio of this process's CPU time is printed above it).

    python bench/agent.py [--rounds 7] [--prompts 16] [--group 4] [--turns 4] [--turn-tokens 16]
                          [--observation 96] [--layers 2] [--cache-mb 256] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from relax.core.agentic import EpisodeLimits, NoToolCalls, Turns
from relax.core.builtin import HFEngineParams
from relax.core.controller.local import LocalHandle
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import SamplingParams, StepResult


class FixedToolOutput:
    """Every turn but the last is answered with the same tool message; the episode ends after ``turns``."""

    def __init__(self, turns: int, observation: str) -> None:
        self.turns, self.observation = turns, observation

    def start(self, sample: Sample) -> FixedToolOutput:
        return self

    def step(self, turn) -> StepResult:
        if turn.index + 1 >= self.turns:
            return StepResult(done=True, reward=1.0)
        return StepResult([{"role": "tool", "content": self.observation}])

    def close(self) -> None:
        pass


class Blocking:
    """The engine as a driver-side rollout role calls it (``controller.roles.RolloutRole.generate``)."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine = engine

    def generate(self, requests):
        return asyncio.run(self.engine.generate(requests))


def observation_text(tokenizer, tokens: int) -> str:
    """Deterministic tool output of about ``tokens`` tokens (a table of numbers)."""
    text, row = "", 0
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:
        text += f"{row}: {row * 37 % 101} {row * 53 % 97}\n"
        row += 1
    return text


def episodes(engine: HFRolloutEngine, prompts: list[list[int]], args, seed: int) -> list[Sample]:
    """Run every episode to its end through ``Turns`` + ``stream_groups``; the finished samples."""
    tokenizer = engine.tokenizer
    limits = EpisodeLimits(
        max_turns=args.turns, max_total_tokens=100_000, max_observation_tokens=100_000, turn_timeout_s=60.0
    )
    turns = Turns(FixedToolOutput(args.turns, args.observation_text), NoToolCalls(), tokenizer, limits, [])
    groups = [
        [Sample(prompt_ids=list(p), group_id=g, index_in_group=i) for i in range(args.group)]
        for g, p in enumerate(prompts)
    ]
    params = SamplingParams(max_new_tokens=args.turn_tokens, ignore_eos=True)
    router = EngineRouter([LocalHandle(Blocking(engine))])
    for _ in stream_groups(router, groups, params, seed=seed, step=seed, timeout_s=600.0, turns=turns):
        pass
    samples = [s for g in groups for s in g]
    assert all(s.metadata["episode"]["turns"] == args.turns for s in samples), "an episode ended early"
    return samples


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [f"{a}*{b}=" for a in range(10) for b in range(10)][:n]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for t in texts
    ]


def timed(
    engine: HFRolloutEngine, prompts, args, seed: int
) -> tuple[float, float, list[Sample], dict[str, int]]:
    """(wall seconds, this process's CPU seconds -- less moved by other load on a shared machine --,
    the finished samples, the engine's work counters for the run)."""
    before = dict(engine.stats)
    wall, cpu = time.perf_counter(), time.process_time()
    samples = episodes(engine, prompts, args, seed)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, samples, {k: engine.stats[k] - before[k] for k in before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--observation", type=int, default=96, help="tokens of tool output after each turn")
    ap.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the quick-start model's)"
    )
    ap.add_argument(
        "--cache-mb",
        type=float,
        default=HFEngineParams().prefix_cache_mb,
        help="the reusing side's prefix_cache_mb (default: the hf engine's)",
    )
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.quickstart_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
        path = build_tiny_model(tmp, **overrides)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).to(args.device).eval().requires_grad_(False)
        reuse = HFRolloutEngine(
            path, device=args.device, model=model, tokenizer=tokenizer, prefix_cache_mb=args.cache_mb
        )
        fresh = HFRolloutEngine(path, device=args.device, model=model, tokenizer=tokenizer)
        args.observation_text = observation_text(tokenizer, args.observation)
        prompts = chat_prompts(tokenizer, args.prompts)
        n = len(prompts) * args.group
        print(
            f"model: quick-start Qwen3 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, "
            f"{model.config.num_hidden_layers} layers) on {args.device}; {len(prompts)} prompts x G={args.group}, "
            f"{args.turns} turns x {args.turn_tokens} tokens, observations of "
            f"{len(tokenizer(args.observation_text, add_special_tokens=False)['input_ids'])} tokens"
        )
        episodes(reuse, prompts[:2], args, seed=10_000)  # warm-up, both sides
        episodes(fresh, prompts[:2], args, seed=10_000)
        ratios, cpu_ratios = [], []
        for r in range(args.rounds):
            sides = [reuse, fresh] if r % 2 == 0 else [fresh, reuse]  # alternate which side goes first
            out = {id(engine): timed(engine, prompts, args, seed=r) for engine in sides}
            (t_reuse, c_reuse, s_reuse, w_reuse), (t_fresh, c_fresh, s_fresh, w_fresh) = (
                out[id(reuse)],
                out[id(fresh)],
            )
            for a, b in zip(s_reuse, s_fresh, strict=True):
                assert a.response_ids == b.response_ids, "prefix reuse changed a trajectory"
                torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, atol=1e-4, rtol=0)
            ratios.append(t_fresh / t_reuse)
            cpu_ratios.append(c_fresh / c_reuse)
            print(
                f"round {r}: {n} episodes, {sum(len(s.response_ids) for s in s_reuse) // n} trajectory tokens each | "
                f"re-prefill {t_fresh:.2f}s {n / t_fresh:.1f} ep/s, {w_fresh['prefill_tokens']} prefill tokens | "
                f"prefix reuse {t_reuse:.2f}s {n / t_reuse:.1f} ep/s, {w_reuse['prefill_tokens']} prefill tokens "
                f"| ratio {t_fresh / t_reuse:.2f} (CPU time {c_fresh / c_reuse:.2f})"
            )
        health = reuse.health()
        print(
            f"prefix cache: hit rate {health['prefix_cache_hit_rate']:.2f} ({health['prefix_cache_hits']} of "
            f"{health['prefix_cache_lookups']} prefills), {health['prefix_cache_reused_tokens']} tokens reused, "
            f"{health['prefix_cache_bytes'] / 2**20:.1f} of {args.cache_mb:g} MiB kept, {health['prefix_cache_evictions']} evicted"
        )
    print(
        f"per-round ratios {min(ratios):.2f}-{max(ratios):.2f}; by CPU time: median {statistics.median(cpu_ratios):.2f}x"
    )
    print(f"agent: {statistics.median(ratios):.2f}x episodes/s prefix reuse vs re-prefill")


if __name__ == "__main__":
    main()
