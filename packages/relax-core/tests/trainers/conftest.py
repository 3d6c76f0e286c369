"""The trainer tests' shared policy batch (8 random rows of varied prompt/response lengths, two groups,
advantages +1 / -0.5 alternating) and two ``TrainerRole`` rank actors on the requesting module's ``cfg``."""

import pytest
import torch

from relax.core.data import Sample, collate


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        prompt = torch.randint(4, 24, (3 + i % 4,), generator=gen).tolist()
        response = torch.randint(4, 24, (2 + (i * 3) % 5,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=prompt, group_id=i // 4, response_ids=response))
    out = collate(samples, pad_id=0)
    out["advantages"] = (
        torch.where(torch.arange(8)[:, None] % 2 == 0, 1.0, -0.5).expand_as(out["response_mask"]).clone()
    )
    return out


@pytest.fixture(scope="module")
def group(ray_local, cfg):
    """Two ``TrainerRole`` ranks on a placement group, rank 0 leading (as ``start_roles`` builds them), for the
    requesting module's ``cfg``."""
    from dataclasses import replace

    import ray

    from relax.core.controller import placement
    from relax.core.controller.contexts import trainer_context
    from relax.core.controller.roles import TrainerRole
    from relax.core.controller.worker_group import spawn

    res = placement.plan_for(cfg)
    trainer_only = placement.Plan(res.groups[:1], res.trainer, ())
    reserved = placement.reserve(trainer_only, timeout_s=60)
    ctx = trainer_context(cfg, cfg.model.path)

    def rank_args(info):
        rank = replace(
            ctx,
            index=info.rank,
            world_size=info.world_size,
            master_addr=info.master_addr,
            master_port=info.master_port,
        )
        return (cfg, rank), {"num_threads": 1}

    g = spawn(
        TrainerRole, "trainer", reserved.trainer_options(), rank_args, reserved.node_ids(trainer_only.trainer)
    )
    ray.get(g.handles[0].lead.remote(g.peers()))
    yield g
    g.kill()
    reserved.remove()
