"""The reward of ``bench/vs_trl.py --task single``, brought as a user brings one: a plugin package's
rule (loaded with ``RELAX_PLUGINS=vs_trl_reward``), registered ``in_driver=True`` like core's rule
rewards, so it costs no Ray actor. TRL's arm calls the same ``first_integer_matches``.
"""

from __future__ import annotations

import re

from relax.core.hookspecs import hookimpl

_INTEGER = re.compile(r"-?\d+")


def first_integer_matches(response: str, label: object) -> float:
    """1.0 when the first integer in ``response`` is ``label``, else 0.0 (no integer: 0.0)."""
    found = _INTEGER.search(response)
    return float(found is not None and int(found.group()) == int(float(str(label))))


class FirstIntegerReward:
    def __init__(self, params: object, ctx: object) -> None:
        pass

    def score(self, sample) -> float:
        return first_integer_matches(sample.response_text, sample.label)


@hookimpl
def relax_register_rewards(register):
    register("first_integer", FirstIntegerReward, in_driver=True)
