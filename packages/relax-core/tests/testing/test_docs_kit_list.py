"""docs/plugins.md lists every conformance test of the kit, one line each, and no test that is gone."""

from __future__ import annotations

import re
from pathlib import Path

from relax.core import testing

DOC = Path(__file__).resolve().parents[4] / "docs" / "plugins.md"
SUITES = [
    testing.RolloutEngineConformance,
    testing.LogprobAgreementConformance,
    testing.TrainerConformance,
    testing.WeightSyncConformance,
    testing.RewardConformance,
    testing.EnvironmentConformance,
    testing.QueueConformance,
    testing.ProcessorConformance,
    testing.MultimodalProcessorConformance,
]


def documented() -> dict[str, set[str]]:
    """Test names listed under each suite's heading line (a line starting with the suite's name)."""
    out: dict[str, set[str]] = {}
    suite = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"`(\w+Conformance)` \(", line)
        if heading:
            suite = out.setdefault(heading.group(1), set())
        elif suite is not None and (item := re.match(r"- `(test_\w+)`: \S", line)):
            suite.add(item.group(1))
        elif not line.startswith("- "):
            suite = None if line.strip() else suite
    return out


def test_every_conformance_test_has_one_line_in_the_docs():
    docs = documented()
    problems = []
    for cls in SUITES:
        tests = {n for n in dir(cls) if n.startswith("test_")}
        listed = docs.get(cls.__name__, set())
        if tests - listed:
            problems.append(f"{cls.__name__}: not in docs/plugins.md: {sorted(tests - listed)}")
        if listed - tests:
            problems.append(
                f"{cls.__name__}: docs/plugins.md lists tests that do not exist: {sorted(listed - tests)}"
            )
    assert not problems, "\n".join(problems)
