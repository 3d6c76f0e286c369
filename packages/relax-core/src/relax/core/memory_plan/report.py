"""The plan as a table (``relax plan``, ``relax validate --plan``) and as the per-recipe rows of docs/gpu.md."""

from __future__ import annotations

from relax.core.memory_plan.plan import MemoryPlan
from relax.core.memory_plan.terms import GIB


def format_plan(plan: MemoryPlan, title: str = "") -> str:
    """Every GPU kind with each term in GiB, its total against the usable memory, then the notes."""
    lines = [
        f"memory plan{f' of {title}' if title else ''}: {plan.gpu_gib:g} GiB per GPU "
        f"({plan.usable / GIB:.1f} usable), {plan.gpus} GPUs reserved"
        + (f" of {plan.stated_gpus} stated (cluster.gpus)" if plan.stated_gpus else "")
    ]
    width = max([len(k) for d in plan.devices for k in d.terms] + [30]) + 2
    for d in plan.devices:
        where = "" if d.reserved else " (not reserved by the placement: a GPU of its own)"
        lines.append(f"{d.name} x{d.count}{where}")
        lines += [f"  {k:<{width}}{v / GIB:>8.2f}" for k, v in d.terms.items() if v]
        verdict = "fits" if d.total <= plan.usable else "DOES NOT FIT"
        lines.append(
            f"  {'total':<{width}}{d.total / GIB:>8.2f}  {verdict} ({d.total / plan.usable:.0%} of usable)"
        )
    lines += [f"note: {n}" for n in plan.notes]
    lines += plan.errors()
    return "\n".join(lines)


def peak(plan: MemoryPlan, prefix: str) -> float:
    """The largest total (GiB) of the plan's GPU kinds whose name starts with ``prefix`` (0: none)."""
    return max((d.total / GIB for d in plan.devices if d.name.startswith(prefix)), default=0.0)
