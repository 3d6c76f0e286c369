"""The multimodal path through ``relax run`` on a tiny Qwen2.5-VL (built locally) with relax-omni's processor:
colocate and async runs train for a few steps; in async mode every batch handed to the trainer carries, row by
row, exactly the tensors a fresh processing of that dataset row gives, and the trainer's own logprobs of the
trained responses equal the rollout's (so it saw the same media and M-RoPE positions). After the run the
engine serves exactly the trainer's weights: all of them (colocate, where the trainer hosts the engine), or,
through the weight sync to the separate async engine, all but the frozen vision tower, which stays as loaded
(``freeze_media_towers``). Rows whose media are missing or whose prompt with its media exceeds
``data.max_prompt_length`` are dropped as they are drawn and counted in every step's metrics."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
import ray
import torch

from relax.core.config import load_config
from relax.core.controller.run import run
from relax.core.data_multimodal import row_media

pytestmark = pytest.mark.slow
ROWS = 6


@pytest.fixture(scope="module")
def omni_setup(tmp_path_factory):
    from PIL import Image, ImageDraw

    from relax.core.testing.multimodal_models import tiny_multimodal_dir

    root = tmp_path_factory.mktemp("omni_path")
    model_dir = tiny_multimodal_dir(root, "qwen2_5_vl")
    rows = []
    for i in range(ROWS):
        img = Image.new("RGB", (56 + 14 * (i % 3), 56), "white")
        for c in range(i % 3 + 1):
            ImageDraw.Draw(img).ellipse((4 + 16 * c, 20, 16 + 16 * c, 32), fill="black")
        img.save(root / f"shapes{i}.png")
        text = f"how many circles? {i}"
        rows.append({"messages": [{"role": "user", "content": [
            {"type": "image", "image": str(root / f"shapes{i}.png")}, {"type": "text", "text": text}]}],
            "label": str(i % 3 + 1)})
    Image.new("RGB", (112, 112), "white").save(root / "big.png")  # 16 image tokens: over max_prompt_length
    bad = [{"messages": [{"role": "user", "content": [{"type": "image", "image": str(root / name)},
                                                      {"type": "text", "text": "how many circles? 9"}]}], "label": "1"}
           for name in ("missing.png", "big.png")]
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
        out["served"] = ray.get(engine.call.remote("state_dict"), timeout=120)
        stream = state.roles.trainer.export_weights.options(num_returns="streaming").remote(1 << 20)
        out["exported"] = {n: t for ref in stream for n, t in ray.get(ref, timeout=120)}

    module = types.ModuleType("omni_run_observer")
    module.relax_on_run_end = collect
    monkeypatch.setattr(plugins, "_MANAGER", plugins.RelaxPluginManager(extra_plugins={"observer": module}))
    return out


def overrides(model_dir, data, run_dir, mode, max_prompt_length):
    return [
        f"model.path={model_dir}", f"data.path={data}", "data.prompt_key=messages", "data.processor=qwen2_5_vl",
        "data.shuffle=false", "data.on_error=skip", f"data.max_prompt_length={max_prompt_length}",
        "data.processor_params.max_pixels=12544", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=3", "trainer.micro_batch_size=2", "trainer.lr=1e-3", "total_steps=2",
        f"run_dir={run_dir}", f"mode={mode}", "logging.progress=false", "logging.console=false",
        "logging.tensorboard=false", "logging.plot=false", "checkpoint.save_hf_final=false", "checkpoint.resume=never",
    ]  # fmt: skip


def fresh(rows, model_dir):
    """Each row processed anew by the same processor: prompt text -> its processed prompt."""
    from transformers import AutoProcessor

    from relax.omni.processors import FAMILIES, OmniProcessorParams, QwenOmniProcessor

    proc = QwenOmniProcessor(AutoProcessor.from_pretrained(model_dir), FAMILIES["qwen2_5_vl"],
                             OmniProcessorParams(max_pixels=12544))
    out = {}
    for i, r in enumerate(rows):
        p = proc.process(r["messages"], [], f"shapes.jsonl:{i + 1}")
        out[p["prompt_text"]] = p
    return out


@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_media_run_trains_and_reaches_the_trainer_intact(ray_session, omni_setup, tmp_path, monkeypatch, observer,
                                                        mode):
    model_dir, data, rows = omni_setup
    import relax.core.controller.modes as modes

    seen: list[dict] = []
    real_collate = modes.collate

    def recording_collate(samples, pad_id):
        batch = real_collate(samples, pad_id)
        seen.extend({"text": s.prompt_text, "media": row_media(batch, i)} for i, s in enumerate(samples))
        return batch

    monkeypatch.setattr(modes, "collate", recording_collate)
    run_dir = tmp_path / mode
    frozen = mode == "async"  # colocate trains and serves every weight; async keeps the vision tower as loaded
    extra = ["trainer.backend_params.freeze_media_towers=true"] if frozen else []
    want = fresh(rows, model_dir)
    longest = max(len(p["prompt_ids"]) for p in want.values())  # the big image's prompt is longer
    summary = run(load_config(None, [*overrides(model_dir, data, run_dir, mode, longest), *extra]))
    assert summary["steps"] == 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in metrics] == [1, 2]
    for m in metrics:  # counted as drawn, in every step's row (not only the load-time counts of the first)
        assert (m["data/skipped_media"], m["data/filtered_too_long"]) == (1, 1), m
        assert m["data/processed_prompts"] >= 2 * m["step"] and m["data/media_image"] == m["data/processed_prompts"]
    assert all(math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in metrics)
    assert all(m["rollout/train_logprob_abs_diff"] < 1e-4 for m in metrics), [m["rollout/train_logprob_abs_diff"] for m in metrics]
    served, exported = observer["served"], observer["exported"]
    towers = {n for n in served if n.startswith("model.visual.")}
    assert towers and set(served) - set(exported) == (towers if frozen else set())
    assert all(torch.equal(served[n], t) for n, t in exported.items())
    from relax.core.multimodal_model import load_model

    initial = load_model(model_dir, "float32").state_dict()
    assert any(not torch.equal(initial[n], t) for n, t in exported.items()), "training moved no weight"
    tower_moved = any(not torch.equal(initial[n], served[n]) for n in towers)
    assert tower_moved != frozen, "the vision tower must train and sync unless frozen"
    if mode == "async":
        assert len(seen) == 2 * 4
        for row in seen:
            expected = {k: v for k, v in want[row["text"]]["inputs"].items() if k != "mm_token_type_ids"}
            assert row["media"].keys() == expected.keys()
            assert all(torch.equal(row["media"][k], expected[k]) for k in expected), row["text"]
        assert np.mean([len(r["media"]["pixel_values"]) for r in seen]) > 0
