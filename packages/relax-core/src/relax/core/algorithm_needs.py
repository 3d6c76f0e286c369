"""What an advantage estimator or policy loss consumes, declared when it is registered.

``register(name, fn, kind=..., needs={...}, modes={...})``: the controller starts the roles a
run's algorithms need from these declarations and ``validate`` derives its errors from them, so a
plugin's algorithm gets exactly the wiring and checks of a built-in one and no algorithm name
appears in the controller. Pure metadata: this module imports neither torch nor the registry, and
it sits below both the plugin registry (which checks each registration's declarations with
:func:`declared`) and ``relax.core.algorithms`` (which reads them back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: need -> what it is and who provides it (the wording of validation errors and docs)
NEEDS: dict[str, str] = {
    "values": "critic values (algorithm.critic.enable: a critic trained inside the trainer)",
    "reference": "reference-model logprobs (a frozen reference role, also started by algorithm.kl.coef > 0)",
    "teacher": "distillation-teacher logprobs (a frozen teacher role on algorithm.teacher_model_path)",
    "greedy_baseline": "the reward of one greedy response per prompt (algorithm.greedy_baseline: true)",
    "old_logprobs": "logprobs of the sampling policy (an estimator that reads them must declare it)",
    "groups": "several responses per prompt, compared within their group (rollout.n_samples_per_prompt >= 2)",
    "kl": "a KL penalty towards the reference model (algorithm.kl.coef > 0, as reward shaping or loss term)",
    "sum_pi_squared": (
        "per-token sum over the vocabulary of squared policy probabilities (the policy trainer computes "
        "it with the old logprobs; an optional trainer capability checked at start-up)"
    ),
}
#: execution modes (``RelaxConfig.mode``)
MODES = ("colocate", "async", "hybrid")
#: needs no trainer or role provides yet: an algorithm declaring one runs from the Python API only
UNPROVIDED: frozenset[str] = frozenset()
#: needs the policy trainer provides through an optional method (``relax.core.protocols``): the
#: controller calls it only when a chosen algorithm declares the need, and start-up refuses a
#: trainer backend without it, naming the backend and the algorithm
TRAINER_CAPABILITIES: dict[str, str] = {"sum_pi_squared": "forward_logprobs_and_sum_pi_squared"}


@dataclass(frozen=True)
class AlgorithmSpec:
    """One registered algorithm and its declarations (``needs`` from :data:`NEEDS`, ``modes`` from
    :data:`MODES`); ``plugin`` is who registered it, for error messages."""

    kind: str
    name: str
    fn: Callable[..., Any]
    needs: frozenset[str] = frozenset()
    modes: frozenset[str] = frozenset(MODES)
    plugin: str = "core"

    @property
    def label(self) -> str:
        kinds = {"advantage": "advantage estimator", "policy_loss": "policy loss"}
        what = kinds.get(self.kind, "KL estimator")
        owner = "" if self.plugin == "core" else f" (plugin {self.plugin!r})"
        return f"{what} {self.name!r}{owner}"


def declared(
    kind: str, name: str, needs: Iterable[str] | None, modes: Iterable[str] | None
) -> tuple[frozenset[str], frozenset[str]]:
    """Check and normalise a registration's ``needs`` / ``modes``; raises ``ValueError`` naming the
    unknown entries and the allowed ones (a typo must not silently drop a role)."""
    problems = []
    for field, given, allowed in [("needs", needs, list(NEEDS)), ("modes", modes, list(MODES))]:
        if isinstance(given, str):
            problems.append(f"{field}= must be a set of names, got the string {given!r}")
            continue
        unknown = sorted(set(given or ()) - set(allowed))
        if unknown:
            problems.append(f"unknown {field} {unknown}; allowed: {', '.join(allowed)}")
    if modes is not None and not isinstance(modes, str) and not set(modes):
        problems.append("modes= is empty; leave it out to support every mode")
    if problems:
        raise ValueError(f"{kind} {name!r}: " + "; ".join(problems))
    return frozenset(needs or ()), frozenset(MODES if modes is None else modes)


def run_needs(estimator: AlgorithmSpec | None, loss: AlgorithmSpec | None, algorithm: Any) -> frozenset[str]:
    """Everything a run's ``algorithm`` section consumes: the chosen estimator's and loss's
    declarations plus what config switches add (``kl.coef > 0`` reads the reference model,
    ``opd_coef > 0`` folds a teacher into the advantages)."""
    needs = set()
    for spec in (estimator, loss):
        if spec is not None:
            needs |= spec.needs
    if algorithm.kl.coef > 0:
        needs.add("reference")
    if algorithm.opd_coef > 0:
        needs.add("teacher")
    return frozenset(needs)
