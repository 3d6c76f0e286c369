"""GPU-only features of the ``sglang`` engine: skipped with a reason on CPU machines, run where CUDA and a CUDA
SGLang environment are present (``RELAX_SGLANG_PYTHON`` = its interpreter; the CPU server env cannot serve a
GPU). One server on cuda:0 serves the kit's tiny model in float32 for the module.

- memory release / resume (``--enable-memory-saver``): the GPU memory the server holds is freed and comes
  back, and it then serves the same tokens;
- ``sglang_tensor`` over CUDA IPC: a trainer on the GPU syncs other weights, served exactly;
- ``sglang_distributed`` over NCCL and tensor parallelism: need a second GPU (one NCCL rank per device).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
    pytest.mark.skipif(
        not os.environ.get("RELAX_SGLANG_PYTHON"),
        reason="needs RELAX_SGLANG_PYTHON: the python of an environment with CUDA SGLang (README)",
    ),
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[4, 5, 6], [7, 8, 9, 10, 11], [12]]


def _params(**kw):
    """A float32, deterministic server with the CPU's KV cap: exact greedy parity with the HF engine (the
    CUDA defaults -- bf16, SGLang's KV sizing, fast kernels -- have their own test below)."""
    from relax.sglang.params import SGLangEngineParams

    exact = dict(dtype="float32", deterministic=True, max_total_tokens=4096)
    return SGLangEngineParams(
        python=os.environ["RELAX_SGLANG_PYTHON"],
        device="cuda",
        mem_fraction_static=0.3,
        startup_timeout_s=900,
        **{**exact, **kw},
    )


def _greedy(engine) -> list[list[int]]:
    reqs = [GenerationRequest(f"g{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    return [r.response_ids for r in asyncio.run(asyncio.wait_for(engine.generate(reqs), 300))]


def _hf_greedy(model_dir: str) -> list[list[int]]:
    from relax.core.engines.hf import HFRolloutEngine

    return _greedy(HFRolloutEngine(model_dir, device="cuda"))


@pytest.fixture(scope="module")
def gpu_engine(tiny_dirs, tmp_path_factory):
    from relax.sglang.engine import SGLangEngine

    engine = SGLangEngine(_params(), tiny_dirs[0], run_dir=str(tmp_path_factory.mktemp("sglang-gpu")))
    yield engine
    engine.close()


def _gpu_used_gib() -> float:
    free, total = torch.cuda.mem_get_info(0)
    return (total - free) / 2**30


def test_greedy_on_cuda_equals_the_hf_engine(gpu_engine, tiny_dirs):
    assert _greedy(gpu_engine) == _hf_greedy(tiny_dirs[0])


def test_a_float32_server_runs_an_attention_backend_that_takes_float32(gpu_engine):
    """On Hopper SGLang's default (FA3) takes no float32: the module's float32 server was launched with Triton's and
    serves (the greedy parity above)."""
    info = gpu_engine.workers[0].get("/server_info")
    assert info["dtype"] == "float32" and info["attention_backend"] == "triton", {
        k: info.get(k) for k in ("dtype", "attention_backend")
    }


def test_release_frees_the_servers_gpu_memory_and_resume_restores_it(gpu_engine):
    before = _greedy(gpu_engine)
    held = _gpu_used_gib()
    gpu_engine.release_memory()
    released = _gpu_used_gib()
    gpu_engine.resume_memory()
    resumed = _gpu_used_gib()
    print(
        f"GPU memory in use: {held:.2f} GiB serving, {released:.2f} GiB released, {resumed:.2f} GiB resumed"
    )
    assert held - released > 0.5 * 0.3 * torch.cuda.mem_get_info(0)[1] / 2**30  # most of its 30% static pool
    assert resumed - released > 0.5 * (held - released)
    assert _greedy(gpu_engine) == before


def test_sglang_tensor_over_cuda_ipc_serves_the_trainers_weights(gpu_engine, tiny_dirs):
    from relax.core.testing import torch_trainer
    from relax.sglang.transports import SGLangTensorSync

    transport = SGLangTensorSync(timeout_s=300)
    try:
        for model_dir in (
            tiny_dirs[1],
            tiny_dirs[0],
        ):  # other weights, then back (the module's engine is shared)
            trainer = torch_trainer(model_dir, device="cuda")
            transport.sync(trainer, [gpu_engine], gpu_engine.weight_version() + 1)
            assert _greedy(gpu_engine) == _hf_greedy(model_dir)
    finally:
        transport.close()


def test_the_cuda_defaults_launch_a_production_server(tiny_dirs, tmp_path):
    """Unset engine params on CUDA: a bf16 server (the run is float32), KV pool sized by SGLang from
    mem_fraction_static (not the CPU's 4096 tokens), deterministic inference off; it serves."""
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.params import SGLangEngineParams

    params = SGLangEngineParams(
        python=os.environ["RELAX_SGLANG_PYTHON"],
        device="cuda",
        mem_fraction_static=0.15,
        startup_timeout_s=900,
    )
    engine = SGLangEngine(params, tiny_dirs[0], dtype="float32", run_dir=str(tmp_path))
    try:
        info = engine.workers[0].get("/server_info")
        print(
            {
                k: info.get(k)
                for k in ("dtype", "max_total_num_tokens", "enable_deterministic_inference", "version")
            }
        )
        assert info["dtype"] == "bfloat16" and not info["enable_deterministic_inference"]
        assert info.get("max_total_num_tokens", 0) > 4096 and info.get("max_total_tokens") is None
        reqs = [GenerationRequest(f"d{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        out = asyncio.run(asyncio.wait_for(engine.generate(reqs), 300))
        assert all(len(r.response_ids) == GREEDY.max_new_tokens for r in out)
        assert all(torch.isfinite(torch.tensor(r.logprobs)).all() for r in out)
    finally:
        engine.close()


def test_megatron_on_cuda_syncs_into_the_server_over_cuda_ipc(gpu_engine, tiny_dirs, tmp_path_factory):
    """relax-megatron's trainer on cuda:0 (NCCL world of one, float32), one step, ``sglang_tensor`` into the
    float32 server: it serves exactly what core's HF engine serves with the exported weights."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.testing import make_batch, make_samples
    from relax.core.testing.models import load_hf_weights
    from relax.core.testing.trainer import exported
    from relax.megatron.parallel import initialize_model_parallel
    from relax.megatron.trainer import MegatronTrainer
    from relax.sglang.testing import load_weights
    from relax.sglang.transports import SGLangTensorSync

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path_factory.mktemp('nccl') / 'store'}", rank=0, world_size=1
    )
    transport = SGLangTensorSync(timeout_s=300)
    version = gpu_engine.weight_version() + 1
    try:
        initialize_model_parallel(tensor_parallel=1, pipeline_parallel=1, seed=1234)
        tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[0])
        trainer = MegatronTrainer(
            tiny_dirs[0],
            objective=build_policy_objective(AlgorithmConfig()),
            lr=1e-2,
            micro_batch_size=4,
            device="cuda",
        )
        batch = make_batch(make_samples(tokenizer, rows=8, seed=5), tokenizer.pad_token_id)
        trainer.train_step({**batch, "old_logprobs": trainer.forward_logprobs(batch)})
        weights, original = exported(trainer), load_hf_weights(tiny_dirs[0])
        assert max(float((weights[n].float() - original[n].float()).abs().max()) for n in original) > 1e-3
        reference = HFRolloutEngine(tiny_dirs[0], device="cuda")
        reference.update_weights(weights, 1)
        transport.sync(trainer, [gpu_engine], version)
        assert _greedy(gpu_engine) == _greedy(reference)
    finally:
        transport.close()
        load_weights(gpu_engine, tiny_dirs[0], version + 1)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the server on different GPUs"
)
def test_sglang_distributed_over_nccl(gpu_engine, tiny_dirs):
    from relax.core.testing import torch_trainer
    from relax.sglang.transports import SGLangDistributedSync

    transport = SGLangDistributedSync(backend="nccl", timeout_s=300)
    try:
        with torch.cuda.device(1):  # the trainer's rank: the server holds cuda:0
            for model_dir in (tiny_dirs[1], tiny_dirs[0]):
                transport.sync(
                    torch_trainer(model_dir, device="cuda:1"), [gpu_engine], gpu_engine.weight_version() + 1
                )
                assert _greedy(gpu_engine) == _hf_greedy(model_dir)
    finally:
        transport.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism (tp_size 2) needs 2 GPUs")
def test_tensor_parallel_server_serves_exactly_and_takes_tensor_updates(tiny_dirs, tmp_path, monkeypatch):
    """Each TP rank's copy of a ``sglang_tensor`` bucket is staged on that rank's GPU (not all on GPU 0)."""
    from relax.core.testing import torch_trainer
    from relax.sglang import engine as engine_module
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.transports import SGLangTensorSync

    engine = SGLangEngine(_params(tp_size=2), tiny_dirs[0], run_dir=str(tmp_path))
    transport = SGLangTensorSync(timeout_s=300)
    staged_on, stage = set(), engine_module.staged
    monkeypatch.setattr(
        engine_module, "staged", lambda named, device: staged_on.add(str(device)) or stage(named, device)
    )
    try:
        assert _greedy(engine) == _hf_greedy(tiny_dirs[0])
        transport.sync(torch_trainer(tiny_dirs[1], device="cuda"), [engine], 1)
        assert _greedy(engine) == _hf_greedy(tiny_dirs[1]) and engine.weight_version() == 1
        assert staged_on == {"cuda:0", "cuda:1"}, staged_on
    finally:
        transport.close()
        engine.close()
