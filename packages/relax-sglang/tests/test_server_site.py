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
from relax.sglang.server_site.relax_sglang_server_patches import per_audio_items

PROBE = """
import os, sys
import sglang.srt.models.qwen3_omni_moe as omni
from sglang.srt.arg_groups import choices
print("patched", getattr(omni.Qwen3OmniMoeThinkerForConditionalGeneration.get_audio_feature, "relax_patched", False))
print("cpu shim", "torch_native" in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES)
print("theirs", os.environ.get("THEIRS_RAN"))
"""


def test_each_audio_becomes_its_own_item_trimmed_to_its_frames():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    feature = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    items = [SimpleNamespace(feature=feature, feature_attention_mask=mask, tag="a"),
             SimpleNamespace(feature=feature[:1, :, :2], feature_attention_mask=mask[:1, :2], tag="b")]
    out = per_audio_items(items)
    assert [(o.tag, tuple(o.feature.shape), o.feature_attention_mask.tolist()) for o in out] == [
        ("a", (1, 3, 3), [[1, 1, 1]]), ("a", (1, 3, 5), [[1] * 5]), ("b", (1, 3, 2), [[1, 1]])]
    assert torch.equal(out[0].feature, feature[:1, :, :3]) and items[0].feature is feature  # inputs untouched


def test_the_server_environment_loads_the_patches(sglang_python, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    env = server_env(SGLangEngineParams(python=sglang_python, env={"PYTHONPATH": str(theirs)}))
    assert env["PYTHONPATH"].split(":")[0] == str(SITE_DIR)
    done = subprocess.run([sglang_python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-4:-1] == ["patched True", "cpu shim True", "theirs yes"], done.stdout
