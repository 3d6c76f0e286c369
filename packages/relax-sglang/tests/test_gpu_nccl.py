"""relax-megatron's trainer into a CUDA SGLang server over NCCL (``sglang_distributed``): the path the
dapo-math-grpo recipe takes, never run before a device existed. The trainer (an NCCL world of one, megatron
TP=1, float32) sits on cuda:1, the server on cuda:0 (NCCL refuses two ranks on one GPU); after one step its
exported weights reach the server, which then serves exactly what core's HF engine serves with them.
Needs two GPUs and ``RELAX_SGLANG_PYTHON`` (a CUDA SGLang env); ``scripts/gpu_check.sh`` runs it in its
2-GPU mode. Over gloo on CPU: ``test_megatron_to_sglang.py``."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from relax.core.protocols import GenerationRequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the server on different GPUs"
    ),
    pytest.mark.skipif(
        not os.environ.get("RELAX_SGLANG_PYTHON"),
        reason="needs RELAX_SGLANG_PYTHON: the python of an environment with CUDA SGLang (docs/gpu.md)",
    ),
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[4, 5, 6], [7, 8, 9, 10, 11], [12]]


def _greedy(engine) -> list[list[int]]:
    reqs = [GenerationRequest(f"n{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    return [r.response_ids for r in asyncio.run(asyncio.wait_for(engine.generate(reqs), 300))]


def test_megatron_on_cuda_syncs_into_the_server_over_nccl(tiny_dirs, tmp_path):
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
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.params import SGLangEngineParams
    from relax.sglang.transports import SGLangDistributedSync

    params = SGLangEngineParams(
        python=os.environ["RELAX_SGLANG_PYTHON"],
        device="cuda",
        dtype="float32",
        deterministic=True,
        max_total_tokens=4096,
        mem_fraction_static=0.3,
        startup_timeout_s=900,
    )
    engine = SGLangEngine(params, tiny_dirs[0], run_dir=str(tmp_path / "sglang"))  # on cuda:0
    torch.cuda.set_device(1)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    transport = SGLangDistributedSync(backend="nccl", timeout_s=300)
    try:
        initialize_model_parallel(tensor_parallel=1, pipeline_parallel=1, seed=1234)
        tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[0])
        trainer = MegatronTrainer(
            tiny_dirs[0],
            objective=build_policy_objective(AlgorithmConfig()),
            lr=1e-2,
            micro_batch_size=4,
            device="cuda:1",
        )
        batch = make_batch(make_samples(tokenizer, rows=8, seed=5), tokenizer.pad_token_id)
        trainer.train_step({**batch, "old_logprobs": trainer.forward_logprobs(batch)})
        weights, original = exported(trainer), load_hf_weights(tiny_dirs[0])
        assert {t.device for t in weights.values()} == {
            torch.device("cuda", 1)
        }  # the export stays on its GPU
        assert (
            max(float((weights[n].float().cpu() - original[n].float()).abs().max()) for n in original) > 1e-3
        )
        reference = HFRolloutEngine(tiny_dirs[0], device="cuda:1")
        reference.update_weights(weights, 1)
        stats = transport.sync(trainer, [engine], 1)
        assert stats["bytes"] > 0 and engine.weight_version() == 1
        assert _greedy(engine) == _greedy(reference)
    finally:
        transport.close()
        engine.close()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
