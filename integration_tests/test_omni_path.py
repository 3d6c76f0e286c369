"""The multimodal path through ``relax run`` with relax-omni's processors on tiny locally built models, two
GRPO steps each. Async (tiny Qwen2.5-VL): every batch handed to the trainer carries, row by row, exactly the
tensors a fresh processing of that dataset row gives; rows whose media are missing or whose prompt with its
media exceeds ``data.max_prompt_length`` are dropped as drawn and counted in every step's metrics; through the
weight sync the engine serves all the trainer's weights but the frozen vision tower (``freeze_media_towers``),
kept as loaded. Colocate (the audio quick-start, tiny Qwen2.5-Omni thinker): the trainer hosts the engine, so
both towers train and are served. In both the trainer's logprobs of the trained responses equal the rollout's
(it saw the same media and M-RoPE positions)."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.controller.local import LocalHandle
from relax.core.controller.run import run
from relax.core.data_multimodal import row_media

pytestmark = pytest.mark.slow
ROWS = 6
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def omni_setup(tmp_path_factory):
    from PIL import Image, ImageDraw

    from relax.omni.tiny_models import tiny_multimodal_dir

    root = tmp_path_factory.mktemp("omni_path")
    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_vl")  # the session's build
    rows = []
    for i in range(ROWS):
        img = Image.new("RGB", (56 + 14 * (i % 3), 56), "white")
        for c in range(i % 3 + 1):
            ImageDraw.Draw(img).ellipse((4 + 16 * c, 20, 16 + 16 * c, 32), fill="black")
        img.save(root / f"shapes{i}.png")
        text = f"how many circles? {i}"
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "image": str(root / f"shapes{i}.png")},
                            {"type": "text", "text": text},
                        ],
                    }
                ],
                "label": str(i % 3 + 1),
            }
        )
    Image.new("RGB", (112, 112), "white").save(root / "big.png")  # 16 image tokens: over max_prompt_length
    bad = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": str(root / name)},
                        {"type": "text", "text": "how many circles? 9"},
                    ],
                }
            ],
            "label": "1",
        }
        for name in ("missing.png", "big.png")
    ]
    data = root / "shapes.jsonl"  # drawn in file order: the first step meets both bad rows
    data.write_text("".join(json.dumps(r) + "\n" for r in [bad[0], rows[0], bad[1], *rows[1:]]))
    return model_dir, data, rows


@pytest.fixture
def observer(monkeypatch):
    """At run end (driver, before teardown): what the engine serves and what the trainer exports."""
    from relax.core import plugins

    out: dict = {}

    def collect(run, status):
        state = run._state  # test-only inspection of the run's roles
        (engine,) = state.fleet.live().values()
        if isinstance(engine, LocalHandle):  # rollout.host=driver: the roles live in this process
            out["served"] = engine.local.call("state_dict")
            out["exported"] = {
                n: t for bucket in state.roles.trainer.local.export_weights(1 << 20) for n, t in bucket
            }
            return
        out["served"] = ray.get(engine.call.remote("state_dict"), timeout=120)
        stream = state.roles.trainer.export_weights.options(num_returns="streaming").remote(1 << 20)
        out["exported"] = {n: t for ref in stream for n, t in ray.get(ref, timeout=120)}

    module = types.ModuleType("omni_run_observer")
    module.relax_on_run_end = collect
    monkeypatch.setattr(plugins, "_MANAGER", plugins.RelaxPluginManager(extra_plugins={"observer": module}))
    return out


def overrides(model_dir, data, run_dir, mode, max_prompt_length):
    return [
        f"model.path={model_dir}",
        f"data.path={data}",
        "data.prompt_key=messages",
        "data.processor=qwen2_5_vl",
        "data.shuffle=false",
        "data.on_error=skip",
        f"data.max_prompt_length={max_prompt_length}",
        "data.processor_params.max_pixels=12544",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=3",
        "trainer.micro_batch_size=2",
        "trainer.lr=1e-3",
        "total_steps=2",
        f"run_dir={run_dir}",
        f"mode={mode}",
        "logging.progress=false",
        "logging.console=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "checkpoint.save_hf_final=false",
        "checkpoint.resume=never",
    ]


def fresh(rows, model_dir):
    """Each row processed anew by the same processor: prompt text -> its processed prompt."""
    from transformers import AutoProcessor

    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor

    proc = QwenOmniProcessor(
        AutoProcessor.from_pretrained(model_dir),
        FAMILIES["qwen2_5_vl"],
        OmniProcessorParams(max_pixels=12544),
    )
    out = {}
    for i, r in enumerate(rows):
        p = proc.process(r["messages"], [], f"shapes.jsonl:{i + 1}")
        out[p["prompt_text"]] = p
    return out


def check_run(run_dir, model_dir, observer, frozen_towers: set[str], trained_towers: set[str]) -> list[dict]:
    """Two finished steps with rollout = trainer logprobs; the engine serves exactly the exported weights,
    minus ``frozen_towers`` (kept as loaded); ``trained_towers`` moved. Returns the metrics rows."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in metrics)
    assert all(m["rollout/train_logprob_abs_diff"] < 1e-4 for m in metrics), [
        m["rollout/train_logprob_abs_diff"] for m in metrics
    ]
    served, exported = observer["served"], observer["exported"]
    assert set(served) - set(exported) == frozen_towers
    assert all(torch.equal(served[n], t) for n, t in exported.items())
    from relax.core.multimodal_model import load_model

    initial = load_model(model_dir, "float32").state_dict()
    assert any(not torch.equal(initial[n], t) for n, t in exported.items()), "training moved no weight"
    assert all(torch.equal(initial[n], served[n]) for n in frozen_towers), "a frozen tower changed"
    if trained_towers:
        assert any(not torch.equal(initial[n], served[n]) for n in trained_towers), (
            "a tower did not train or sync"
        )
    return metrics


def test_async_media_run_reaches_the_trainer_intact(ray_session, omni_setup, tmp_path, monkeypatch, observer):
    """Async (separate engine, weight sync) with the vision tower frozen; bad rows counted per step."""
    model_dir, data, rows = omni_setup
    import relax.core.controller.modes as modes

    seen: list[dict] = []
    real_collate = modes.collate

    def recording_collate(samples, pad_id):
        batch = real_collate(samples, pad_id)
        seen.extend({"text": s.prompt_text, "media": row_media(batch, i)} for i, s in enumerate(samples))
        return batch

    monkeypatch.setattr(modes, "collate", recording_collate)
    want = fresh(rows, model_dir)
    longest = max(len(p["prompt_ids"]) for p in want.values())  # the big image's prompt is longer
    extra = ["trainer.backend_params.freeze_media_towers=true"]
    summary = run(load_config(None, [*overrides(model_dir, data, tmp_path, "async", longest), *extra]))
    assert summary["steps"] == 2
    towers = {n for n in observer["served"] if n.startswith("model.visual.")}
    metrics = check_run(tmp_path, model_dir, observer, frozen_towers=towers, trained_towers=set())
    for m in metrics:  # counted as drawn, in every step's row (not only the load-time counts of the first)
        assert (m["data/skipped_media"], m["data/filtered_too_long"]) == (1, 1), m
        assert (
            m["data/processed_prompts"] >= 2 * m["step"]
            and m["data/media_image"] == m["data/processed_prompts"]
        )
    assert towers and len(seen) == 2 * 4
    for row in seen:
        expected = {k: v for k, v in want[row["text"]]["inputs"].items() if k != "mm_token_type_ids"}
        assert row["media"].keys() == expected.keys()
        assert all(torch.equal(row["media"][k], expected[k]) for k in expected), row["text"]
    assert np.mean([len(r["media"]["pixel_values"]) for r in seen]) > 0


def test_audio_quickstart_runs_colocate(ray_session, tmp_path_factory, tmp_path, observer):
    """``examples/quickstart_omni_audio.yaml`` (tiny Qwen2.5-Omni thinker, generated tones + circles task) for
    two GRPO steps in colocate: the trainer hosts the engine, both in the driver (``rollout.host`` auto), so both
    towers train and are served."""
    from relax.omni.synthetic import make_dataset
    from relax.omni.tiny_models import tiny_multimodal_dir

    model_dir = tiny_multimodal_dir(tmp_path_factory.getbasetemp(), "qwen2_5_omni")
    data = make_dataset(tmp_path_factory.mktemp("omni_audio_task") / "audio", ("audio", "image"), rows=8)
    overrides = [
        f"model.path={model_dir}",
        f"data.path={data}",
        f"data.processor_params.media_root={data.parent}",
        "total_steps=2",
        "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "algorithm.entropy_coef=0.03",  # a gradient even when a group's rewards tie (the file trains without)
        f"run_dir={tmp_path}",
        "logging.progress=false",
        "logging.console=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "checkpoint.save_hf_final=false",
    ]
    summary = run(load_config(str(EXAMPLES / "quickstart_omni_audio.yaml"), overrides))
    assert summary["steps"] == 2
    towers = {n for n in observer["served"] if n.startswith(("model.audio_tower.", "model.visual."))}
    assert {n.split(".")[1] for n in towers} == {"audio_tower", "visual"}
    metrics = check_run(tmp_path, model_dir, observer, frozen_towers=set(), trained_towers=towers)
    assert all(m["groups/kept"] == 2 and m["data/skipped_media"] == 0 for m in metrics)
    assert metrics[-1]["data/media_audio"] > 0 and metrics[-1]["data/media_image"] > 0
