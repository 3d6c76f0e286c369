"""Rollout throughput: the built-in HF engine vs ``model.generate`` on the same model and requests.

Workload (GRPO-shaped): ``--prompts`` quick-start chat prompts ("3+4=") x G=``--group`` samples,
at most ``--batch`` rows decoding at once on both sides, temperature 1, no top-k/top-p. Response
lengths are log-normal (median ``--median``, sigma ``--sigma``, clipped to ``--max-len``): a long
tail, as RL rollouts have. Both sides produce exactly those lengths (EOS ignored) so they do the
same useful work; tokens/s counts only the response tokens the requests asked for.

- baseline: ``model.generate(do_sample=True, num_return_sequences=G)`` on ``batch // G`` prompts
  at a time (how TRL's GRPOTrainer generates without vLLM); each batch runs until its longest row
  is done (a finished row keeps decoding padding), its prompt prefilled G times.
- engine: ``HFRolloutEngine(max_batch_size=batch).generate`` on all requests at once; it also
  returns per-token logprobs, which ``generate`` here does not.

Model: the quick-start's tiny Qwen3 (``relax.core.quickstart_model``), built locally, fp32 on CPU
with one torch thread for both. Each round runs both sides on the same lengths, in alternating
order, so machine-speed drift hits both alike; the headline is the median of the per-round
wall-clock ratios (the ratio of this process's CPU time, less moved by other load on a shared
machine, is printed above it).

    python bench/engine.py [--rounds 5] [--prompts 32] [--group 8] [--batch 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch


def build(directory: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.quickstart_model import build_tiny_model

    path = build_tiny_model(directory)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None  # the baseline runs to max_new_tokens, as ignore_eos does
    return path, model, AutoTokenizer.from_pretrained(path)


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [f"{a}+{b}=" for a in range(10) for b in range(10)][:n]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for t in texts
    ]


def lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    drawn = torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * sigma) * median
    return drawn.round().clamp(1, cap).long().tolist()


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): CPU time is less moved by other processes' load."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def run_generate(model, prompt_ids: list[list[int]], lens: list[int], group: int, batch: int) -> None:
    from transformers import GenerationConfig

    per_call = batch // group
    for i in range(0, len(prompt_ids), per_call):
        chunk = prompt_ids[i : i + per_call]
        longest = max(lens[i * group : (i + len(chunk)) * group])
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=longest,
            eos_token_id=None,
            pad_token_id=0,
            num_return_sequences=group,
        )
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert out.shape == (len(chunk) * group, width + longest), out.shape


def run_engine(engine, prompt_ids: list[list[int]], lens: list[int], group: int, seed: int) -> None:
    from relax.core.protocols import GenerationRequest, SamplingParams

    requests = [
        GenerationRequest(
            f"{i // group}/{i % group}",
            prompt_ids[i // group],
            SamplingParams(max_new_tokens=n, ignore_eos=True, seed=seed * 100_000 + i),
        )
        for i, n in enumerate(lens)
    ]
    results = asyncio.run(engine.generate(requests))
    assert [len(r.response_ids) for r in results] == lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--median", type=float, default=24.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=200)
    args = ap.parse_args()
    if args.batch % args.group:
        ap.error(f"--batch ({args.batch}) must be a multiple of --group ({args.group})")
    torch.set_num_threads(1)

    from relax.core.engines.hf import HFRolloutEngine

    with tempfile.TemporaryDirectory() as tmp:
        path, model, tokenizer = build(tmp)
        engine = HFRolloutEngine(path, max_batch_size=args.batch)
        prompt_ids = prompts(tokenizer, args.prompts)
        n = len(prompt_ids) * args.group
        print(
            f"model: quick-start Qwen3 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params), "
            f"{len(prompt_ids)} prompts x G={args.group}, batch {args.batch}, "
            f"lengths log-normal(median {args.median:g}, sigma {args.sigma:g}) <= {args.max_len}"
        )
        run_generate(model, prompt_ids[: args.batch // args.group], [4] * args.batch, args.group, args.batch)
        run_engine(engine, prompt_ids[:2], [4] * 2 * args.group, args.group, seed=0)  # warm-up
        ratios, cpu_ratios = [], []
        for r in range(args.rounds):
            lens = lengths(n, args.median, args.sigma, args.max_len, seed=r)
            tokens = sum(lens)
            stats = dict(engine.stats)
            sides = [
                (run_generate, model, prompt_ids, lens, args.group, args.batch),
                (run_engine, engine, prompt_ids, lens, args.group, r),
            ]
            if r % 2:  # alternate which side goes first
                (t_eng, c_eng), (t_gen, c_gen) = [timed(*side) for side in reversed(sides)]
            else:
                (t_gen, c_gen), (t_eng, c_eng) = [timed(*side) for side in sides]
            steps = engine.stats["decode_steps"] - stats["decode_steps"]
            ratios.append(t_gen / t_eng)
            cpu_ratios.append(c_gen / c_eng)
            print(
                f"round {r}: {n} responses, {tokens} tokens (longest {max(lens)}) | "
                f"generate {t_gen:.2f}s {tokens / t_gen:.0f} tok/s | "
                f"engine {t_eng:.2f}s {tokens / t_eng:.0f} tok/s, {steps} steps, "
                f"{engine.stats['prefill_rows'] - stats['prefill_rows']} prefills "
                f"| ratio {t_gen / t_eng:.2f} (CPU time {c_gen / c_eng:.2f})"
            )
    print(
        f"per-round ratios {min(ratios):.2f}-{max(ratios):.2f}; "
        f"by CPU time: median {statistics.median(cpu_ratios):.2f}x"
    )
    print(f"engine: {statistics.median(ratios):.2f}x tokens/s (Relax HF engine / model.generate)")


if __name__ == "__main__":
    main()
