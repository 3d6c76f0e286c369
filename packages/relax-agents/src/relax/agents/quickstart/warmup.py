"""A short supervised warm-up that teaches the tiny model the tool-call *format*, not the task.

An instruct model already knows how to write a tool call and how to use what the tool returned;
a randomly initialised one does not, and RL cannot discover a 35-token JSON call by chance. So the
model first imitates a mixture of transcripts: some call the calculator with the prompt's
expression and copy its result, the others answer at once with a *random* number. The *decision*
(the first assistant token: call or answer?) is trained on every direct transcript but only on a
share of the tool transcripts, so the model learns to copy from many examples while calling the
tool only in about ``call_rate`` of its episodes, and its direct answers are (almost) always wrong.
RL has to find out that calling the tool is what gets rewarded.

Transcripts are token ids exactly as a rollout produces them: the chat-templated prompt, the
sampled call, and the tool observation rendered by core's :class:`ObservationRenderer` as a
continuation (loss only on the assistant's tokens).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax.agents.quickstart.task import problem, tool_call_text


@dataclass(frozen=True)
class WarmupConfig:
    tool_fraction: float = 0.8  # share of transcripts that call the calculator (and copy its result)
    call_rate: float = 0.2  # how often the warmed-up model starts with a call: the *decision* is trained
    # on all direct transcripts and only on enough tool transcripts to give this rate
    steps: int = 400
    batch_size: int = 32
    lr: float = 6e-3
    seed: int = 0


def conversation_transcript(
    tokenizer: Any, renderer: Any, prompt: list[dict[str, Any]], turns: list[str | list[dict[str, Any]]]
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one episode exactly as a rollout builds it, for any task: the chat-templated
    ``prompt`` (mask 0), then ``turns`` in order -- a string is an assistant turn (its tokens plus the EOS,
    mask 1), a list of messages is an observation (``renderer.ids``, as core appends it, mask 0)."""
    eos = tokenizer.eos_token_id
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = enc(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
    ids, mask = list(head), [0] * len(head)
    for turn in turns:
        part, trained = (
            ([*enc(turn), eos], 1)
            if isinstance(turn, str)
            else (renderer.ids(turn, ended_with=tokenizer.eos_token), 0)
        )
        ids.extend(part)
        mask.extend([trained] * len(part))
    return ids, mask


def transcript(
    tokenizer: Any, renderer: Any, a: int, b: int, use_tool: bool, guess: int, train_decision: bool = True
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one calculator episode: with the tool, or a direct ``guess``. Without
    ``train_decision`` the first assistant token (call or answer?) carries no loss."""
    prompt = [{"role": "user", "content": f"{a}*{b}="}]
    turns: list[str | list[dict[str, Any]]] = (
        [tool_call_text(f"{a}*{b}"), [{"role": "tool", "content": str(a * b)}], str(a * b)]
        if use_tool
        else [str(guess)]
    )
    ids, mask = conversation_transcript(tokenizer, renderer, prompt, turns)
    if not train_decision:
        mask[mask.index(1)] = 0
    return ids, mask


def decision_share(config: WarmupConfig) -> float:
    """Share of tool transcripts whose first token is trained so that calls start at ``call_rate``."""
    direct, tool, rate = 1 - config.tool_fraction, config.tool_fraction, config.call_rate
    return min(1.0, rate * direct / ((1 - rate) * tool)) if tool else 0.0


def warm_up(model: Any, tokenizer: Any, config: WarmupConfig = WarmupConfig()) -> list[float]:
    """Train ``model`` in place on generated calculator transcripts; returns the loss per step. Deterministic."""
    from relax.core.agentic import ObservationRenderer

    renderer = ObservationRenderer(tokenizer)
    share = decision_share(config)

    def example(rng: random.Random) -> tuple[list[int], list[int]]:
        a, b = problem(rng)
        use_tool = rng.random() < config.tool_fraction
        decide = not use_tool or rng.random() < share
        return transcript(
            tokenizer, renderer, a, b, use_tool, guess=rng.randint(10_000, 998_001), train_decision=decide
        )

    return supervised_warm_up(model, example, config.steps, config.batch_size, config.lr, config.seed)


def supervised_warm_up(
    model: Any,
    example: Callable[[random.Random], tuple[list[int], list[int]]],
    steps: int = 400,
    batch_size: int = 32,
    lr: float = 6e-3,
    seed: int = 0,
) -> list[float]:
    """Train ``model`` in place on ``example(rng)`` transcripts -- (token ids, loss mask), e.g. from
    :func:`conversation_transcript` with your own task's prompts, tool calls and observations -- so that a
    tiny model knows your tool-call format before RL. Returns the loss per step; deterministic in ``seed``."""
    import torch

    rng = random.Random(seed)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
        model.train()
        for _ in range(steps):
            loss = _token_mean_loss(model, [example(rng) for _ in range(batch_size)])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
    model.eval()
    return losses


def _lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over 20 steps, constant, linear decay over the last 30%."""
    return min(1.0, (step + 1) / 20, (steps - step) / (0.3 * steps))


def _token_mean_loss(model: Any, batch: list[tuple[list[int], list[int]]]) -> Any:
    """Cross-entropy over the batch's trained tokens, computed per length group: the short direct
    answers are not padded to the length of a tool transcript (same value, a fraction of the work)."""
    import torch

    total, count = 0.0, 0
    for width in sorted({len(ids) for ids, _ in batch}):
        group = [(ids, mask) for ids, mask in batch if len(ids) == width]
        input_ids = torch.tensor([ids for ids, _ in group])
        labels = torch.tensor(
            [[t if m else -100 for t, m in zip(ids, mask, strict=True)] for ids, mask in group]
        )
        logits = model(input_ids=input_ids).logits[:, :-1]
        targets = labels[:, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        count += int((targets != -100).sum())
    return total / max(count, 1)
