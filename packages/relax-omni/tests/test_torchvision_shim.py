"""The torchvision 0.28 import shim (``_relax_torchvision_shim``, installed process-wide by a ``.pth``):
still needed (without it torchvision does not import beside CPU torch 2.13), still working (with it
torchvision, the VL processors and a Qwen3 model load), and active in Ray workers. Fresh interpreters
(a subprocess, a Ray worker) so nothing this test process imported decides the outcome."""

from __future__ import annotations

import subprocess
import sys

WITHOUT = """
import sys
hooks = [f for f in sys.meta_path if type(f).__name__ == "_BeforeTorchvision"]
assert hooks, "the .pth did not install the shim's import hook"
sys.meta_path.remove(hooks[0])
try:
    import torchvision
except Exception as e:
    print("FAILED:", e)
else:
    print("IMPORTED", torchvision.__version__)
"""


def test_shim_still_needed():
    out = subprocess.run([sys.executable, "-c", WITHOUT], capture_output=True, text=True, timeout=300).stdout
    assert "FAILED: operator torchvision::nms does not exist" in out, (
        "torchvision now imports without the shim: delete _relax_torchvision_shim and its .pth\n" + out
    )


def test_shim_works_in_a_fresh_ray_worker(ray_session, tmp_path_factory):
    """A Ray worker is a fresh interpreter of this venv: the .pth hook lets torchvision, a VL processor
    (its video processor needs torchvision) and a Qwen3 model load there."""
    ray = ray_session
    from relax.core.testing.models import tiny_model_dir
    from relax.omni.tiny_models import tiny_multimodal_dir

    root = tmp_path_factory.getbasetemp()
    vl_dir, lm_dir = tiny_multimodal_dir(root, "qwen2_5_vl"), tiny_model_dir(root)

    @ray.remote(num_cpus=0)
    def load(vl_dir: str, lm_dir: str) -> list[str]:
        import sys

        import torchvision
        from transformers import AutoModelForCausalLM, AutoProcessor

        fresh = "_relax_torchvision_shim" in sys.modules  # imported by the .pth, not by this test
        proc = AutoProcessor.from_pretrained(vl_dir)
        model = AutoModelForCausalLM.from_pretrained(lm_dir)
        return [
            str(fresh),
            torchvision.__version__,
            type(proc.video_processor).__name__,
            type(model).__name__,
        ]

    fresh, version, video, model = ray.get(load.remote(vl_dir, lm_dir), timeout=300)
    assert fresh == "True" and version.startswith("0.28")
    assert (video, model) == ("Qwen2VLVideoProcessor", "Qwen3ForCausalLM")
