"""Relax's SGLang server patches (``relax.sglang.server_site``) reach every launched server: the per-audio
Qwen3-Omni encoding is installed in the real server environment, the CPU shims still load through its patch
loader, and an environment's own ``sitecustomize`` still runs."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import torch

from relax.sglang.params import SGLangEngineParams
from relax.sglang.server import server_env
from relax.sglang.server_site import SITE_DIR
from relax.sglang.server_site.relax_sglang_server_patches import (
    metadata_with_timestamps,
    per_audio_items,
    relax_tags,
)

PROBE = """
import os, sys
import sglang.srt.models.qwen3_omni_moe as omni
from sglang.srt.arg_groups import choices
import sglang.srt.multimodal.processors.qwen_vl as qwen_vl
import sglang.srt.managers.scheduler_components.weight_updater as updater
print("patched", getattr(omni.Qwen3OmniMoeThinkerForConditionalGeneration.get_audio_feature, "relax_patched", False)
      and getattr(qwen_vl.preprocess_video, "relax_patched", False)
      and getattr(updater.SchedulerWeightUpdaterManager.record_weight_version_after_update, "relax_patched", False))
print("cpu shim", "torch_native" in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES)
print("theirs", os.environ.get("THEIRS_RAN"))
"""


def test_each_audio_becomes_its_own_item_trimmed_to_its_frames():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    feature = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    items = [
        SimpleNamespace(feature=feature, feature_attention_mask=mask, tag="a"),
        SimpleNamespace(feature=feature[:1, :, :2], feature_attention_mask=mask[:1, :2], tag="b"),
    ]
    out = per_audio_items(items)
    assert [(o.tag, tuple(o.feature.shape), o.feature_attention_mask.tolist()) for o in out] == [
        ("a", (1, 3, 3), [[1, 1, 1]]),
        ("a", (1, 3, 5), [[1] * 5]),
        ("b", (1, 3, 2), [[1, 1]]),
    ]
    assert torch.equal(out[0].feature, feature[:1, :, :3]) and items[0].feature is feature  # inputs untouched


def test_tagged_frame_times_become_the_metadata_qwen3_vl_reads_them_from(tmp_path):
    """The engine's container tags come back on the server side, and the metadata built from the times makes
    the HF Qwen3-VL processor's timestamp rule (the mean of each temporal patch's indices / fps) give them;
    another client's (or an unreadable) video is not Relax's and is left alone."""
    import base64

    import numpy as np
    from transformers import Qwen3VLProcessor

    from relax.sglang.media import video_data_url

    frames = np.zeros((4, 32, 32, 3), dtype=np.uint8)
    url = video_data_url(frames, 2.0, ["0.2", "1.5"])
    data = base64.b64decode(url.split(",", 1)[1])
    assert relax_tags(data)["RELAX_TIMESTAMPS"] == "0.2,1.5"
    assert "RELAX_TIMESTAMPS" not in relax_tags(
        base64.b64decode(video_data_url(frames, 2.0).split(",", 1)[1])
    )
    assert relax_tags(b"not a video") is None
    (tmp_path / "v.mkv").write_bytes(data)
    assert relax_tags(str(tmp_path / "v.mkv"))["RELAX_TIMESTAMPS"] == "0.2,1.5"
    untagged = tmp_path / "plain.mkv"  # another client's video: not Relax's, left alone
    import av

    with av.open(str(untagged), "w", format="matroska") as out:
        stream = out.add_stream("ffv1", rate=2)
        stream.width = stream.height = 32
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    assert relax_tags(str(untagged)) is None
    meta = metadata_with_timestamps(
        {"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4}, 4, [0.2, 1.5]
    )
    assert meta["total_num_frames"] == 4
    times = Qwen3VLProcessor._calculate_timestamps(None, meta["frames_indices"], meta["fps"], 2)
    assert [f"<{t:.1f} seconds>" for t in times] == ["<0.2 seconds>", "<1.5 seconds>"]


def test_the_server_environment_loads_the_patches(sglang_python, tmp_path, monkeypatch):
    monkeypatch.setenv(
        "PYTHONDONTWRITEBYTECODE", "1"
    )  # launches still write bytecode: later ones import faster
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    env = server_env(SGLangEngineParams(python=sglang_python, env={"PYTHONPATH": str(theirs)}))
    assert env["PYTHONPATH"].split(":")[0] == str(SITE_DIR) and "PYTHONDONTWRITEBYTECODE" not in env
    done = subprocess.run([sglang_python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-4:-1] == ["patched True", "cpu shim True", "theirs yes"], done.stdout
