"""Pure estimators over the ``n`` scored responses to one prompt: pass@k, mean@k, maj@k.

pass@k is the unbiased estimator of Chen et al., "Evaluating Large Language Models Trained on Code"
(the Codex paper, arXiv:2107.03374, eq. 1): with ``n`` samples of which ``c`` are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

the probability that at least one of ``k`` samples drawn without replacement from the ``n`` is correct,
computed as the numerically stable product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's
reference implementation). Averaged over prompts it is an unbiased estimate of the pass@k of the policy.
mean@k is the mean score of the responses (their accuracy when scores are 0/1), maj@k the score of the
most frequent answer (self-consistency, Wang et al. 2022, arXiv:2203.11171), ties to the answer seen first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_BOXED = "\\boxed{"
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al. 2021, eq. 1); needs 1 <= k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct one
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def ks_for(n: int) -> list[int]:
    """The k reported for ``n`` samples: powers of two below ``n``, and ``n`` itself (1, 2, 4, ..., n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def mean_at_k(scores: Sequence[float]) -> float:
    """Mean score of the responses to one prompt."""
    if not scores:
        raise ValueError("mean@k of no responses")
    return sum(scores) / len(scores)


def maj_at_k(answers: Sequence[str | None], scores: Sequence[float]) -> float | None:
    """Score of the most frequent answer (ties: the one seen first), or None when some response has no
    answer to compare (``None``): then majority voting is undefined for this prompt."""
    if len(answers) != len(scores) or not answers:
        raise ValueError(
            f"maj@k needs one score per answer, got {len(answers)} answers, {len(scores)} scores"
        )
    if any(a is None for a in answers):
        return None
    counts: dict[str, int] = {}
    for a in answers:
        counts[a] = counts.get(a, 0) + 1
    best = max(counts, key=lambda a: (counts[a], -answers.index(a)))
    return max(s for a, s in zip(answers, scores, strict=True) if a == best)


def extract_answer(text: str) -> str | None:
    """The answer a response gives, for majority voting: the last ``\\boxed{...}`` content, else the last
    number (thousands separators removed), else the stripped text; None for an empty response."""
    start = text.rfind(_BOXED)
    if start >= 0:
        depth, i = 0, start + len(_BOXED) - 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", "").lstrip("+")
    stripped = " ".join(text.split())
    return stripped or None
