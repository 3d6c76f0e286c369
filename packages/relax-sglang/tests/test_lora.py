"""Adapter-only weight syncs into SGLang (``trainer.lora``): a real server launched with LoRA enabled (its own,
module-scoped: the session's shared server has no LoRA flags), fed by a real LoRA torch trainer's export,
checked against core's HF engine with the same adapter merged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.core.config import LoraConfig
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing.models import run_async

LORA = LoraConfig(rank=4, alpha=8.0)  # alpha != rank: the engine must not scale lora_B a second time
PROMPTS = [[4, 5, 6], [7, 8, 9, 10, 11], [12, 3]]
NEW_TOKENS = 8


def _objective(inputs):
    return (inputs.logprobs * 0).sum(), {}


def _set_adapter(trainer, seed: int) -> None:
    """Seeded, clearly non-zero adapter weights (peft starts lora_B at zero: an adapter that changes nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def _sync(engine, trainer, version: int) -> None:
    engine.begin_weight_update(version)
    for bucket in trainer.export_weights(bucket_bytes=4096):  # several buckets: the engine collects them
        engine.update_weights(bucket, version)
    engine.end_weight_update(version)


def _greedy(engine):
    reqs = [
        GenerationRequest(
            f"l{i}", p, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        )
        for i, p in enumerate(PROMPTS)
    ]
    return run_async(engine.generate(reqs), timeout_s=300)


@pytest.fixture(scope="module")
def lora_engine(sglang_python, tiny_dirs, tmp_path_factory):
    from relax.sglang.engine import SGLangEngine
    from relax.sglang.testing import engine_params

    engine = SGLangEngine(
        engine_params(), tiny_dirs[0], run_dir=str(tmp_path_factory.mktemp("sglang-lora")), lora=LORA
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trainer(tiny_dirs):
    from relax.core.trainers.torch_trainer import TorchTrainer

    return TorchTrainer(tiny_dirs[0], objective=_objective, lr=1e-3, micro_batch_size=8, lora=LORA)


@pytest.fixture(scope="module")
def hf_engine(tiny_dirs):
    from relax.core.engines.hf import HFRolloutEngine

    return HFRolloutEngine(tiny_dirs[0])


def _hf_sync(hf, trainer, version: int) -> None:
    for bucket in trainer.export_weights(bucket_bytes=4096):
        hf.update_weights(bucket, version=version)


def _assert_same(got, want, version: int) -> None:
    for p, g, w in zip(PROMPTS, got, want, strict=True):
        assert g.response_ids == w.response_ids, f"prompt {p}: SGLang {g.response_ids} vs HF {w.response_ids}"
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
        assert g.versions == [version] * NEW_TOKENS


def test_sglang_serves_each_synced_adapter_exactly(lora_engine, trainer, hf_engine):
    base = _greedy(lora_engine)
    _set_adapter(trainer, seed=1)
    _sync(lora_engine, trainer, 1)
    _hf_sync(hf_engine, trainer, 1)
    assert lora_engine.weight_version() == 1
    v1 = _greedy(lora_engine)
    _assert_same(v1, _greedy(hf_engine), 1)
    assert [r.response_ids for r in v1] != [r.response_ids for r in base]  # the adapter does change the model

    _set_adapter(trainer, seed=2)  # a second version replaces the first
    _sync(lora_engine, trainer, 2)
    _hf_sync(hf_engine, trainer, 2)
    v2 = _greedy(lora_engine)
    _assert_same(v2, _greedy(hf_engine), 2)
    assert [r.response_ids for r in v2] != [r.response_ids for r in v1]
    served = {m["id"] for m in lora_engine.client.get("/v1/models")["data"]}
    assert "relax-lora-v2" in served and "relax-lora-v1" not in served, served  # the old version is unloaded


def test_bytes_per_sync_are_the_adapters_size(lora_engine, trainer):
    from relax.core.trainers import lora as lora_adapters

    _sync(lora_engine, trainer, 3)
    sent = lora_engine.last_sync_bytes
    assert sent == lora_adapters.adapter_bytes(trainer.model)
    full = sum(t.numel() * t.element_size() for t in trainer.model.get_base_model().state_dict().values())
    assert sent < full / 10


def test_a_sync_mid_generation_continues_under_the_new_adapter(lora_engine, trainer, hf_engine):
    """rollout.partial_rollout in_place: pause, sync, resume; the response's tokens carry both versions and
    the ones after the sync are exactly what the new adapter generates from there."""
    import asyncio

    n, prompt = 200, PROMPTS[1]
    _set_adapter(trainer, seed=3)
    _sync(lora_engine, trainer, 4)
    _set_adapter(trainer, seed=4)

    async def run():
        req = GenerationRequest(
            "mid", prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        )
        task = asyncio.ensure_future(lora_engine.generate([req]))
        await asyncio.sleep(0.3)
        lora_engine.pause()
        try:
            await asyncio.to_thread(_sync, lora_engine, trainer, 5)
        finally:
            lora_engine.resume()
        return (await task)[0]

    res = run_async(run(), timeout_s=300)
    k = res.versions.count(4)
    assert len(res.response_ids) == n and 0 < k < n and res.versions == [4] * k + [5] * (n - k), res.versions
    _hf_sync(hf_engine, trainer, 5)
    cont = GenerationRequest(
        "ref",
        prompt + res.response_ids[:k],
        SamplingParams(temperature=0.0, max_new_tokens=n - k, ignore_eos=True),
    )
    (want,) = run_async(hf_engine.generate([cont]), timeout_s=300)
    assert res.response_ids[k:] == want.response_ids
    torch.testing.assert_close(torch.tensor(res.logprobs[k:]), torch.tensor(want.logprobs), atol=1e-4, rtol=0)


def test_a_request_naming_a_replaced_adapter_goes_again_under_the_served_one(lora_engine, monkeypatch):
    """A request built before a sync reaches the server after the old adapter was unloaded (SGLang answers
    400): it has not started, so the engine resubmits it under the adapter now served."""
    served, send = lora_engine._adapter, lora_engine.client.generate
    assert served is not None
    (want,) = run_async(
        lora_engine.generate(
            [
                GenerationRequest(
                    "w",
                    PROMPTS[0],
                    SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True),
                )
            ]
        ),
        timeout_s=300,
    )
    sent = []

    async def sync_lands_meanwhile(payload):
        sent.append(payload["lora_path"])
        lora_engine._adapter = served  # the sync that unloaded relax-lora-v0 completes while this one travels
        return await send(payload)

    monkeypatch.setattr(lora_engine, "_adapter", "relax-lora-v0")  # never loaded: as good as unloaded
    monkeypatch.setattr(lora_engine.client, "generate", sync_lands_meanwhile)
    (got,) = run_async(
        lora_engine.generate(
            [
                GenerationRequest(
                    "r",
                    PROMPTS[0],
                    SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True),
                )
            ]
        ),
        timeout_s=300,
    )
    assert sent == ["relax-lora-v0", served] and got.response_ids == want.response_ids


def test_async_lora_run_attached_to_the_lora_server(ray_session, lora_engine, tiny_dirs, tmp_path):
    """``relax run`` end to end (Ray, a LoRA torch trainer, ``sglang_tensor``) on this module's server by URL:
    each step's adapter reaches the server as a new version and the old one is unloaded."""
    import json

    from relax.core.config import load_config
    from relax.core.controller.run import run

    steps, run_dir = 3, tmp_path / "run"
    lora_engine.client.post("/update_weight_version", {"new_version": "0", "abort_all_requests": False})
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"model.path={tiny_dirs[0]}",
            f"total_steps={steps}",
            "mode=async",
            "max_staleness=1",
            "rollout.engine=sglang",
            f"rollout.engine_params.urls=[{lora_engine.url}]",
            "weight_sync.transport=sglang_tensor",
            f"trainer.lora.rank={LORA.rank}",
            f"trainer.lora.alpha={LORA.alpha}",
            "trainer.lr=0.002",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=3",
            "trainer.micro_batch_size=16",
            "data.task_size=64",
            "logging.progress=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.save_every=0",
            "checkpoint.save_hf_final=false",
            "checkpoint.resume=never",
        ],
    )
    run(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert all(0 <= r["staleness/mean"] <= r["staleness/max"] <= 1 for r in rows), rows
    assert int(lora_engine.client.get("/model_info")["weight_version"]) == steps
    served = {m["id"] for m in lora_engine.client.get("/v1/models")["data"]}
    assert f"relax-lora-v{steps}" in served and not {f"relax-lora-v{v}" for v in range(1, steps)} & served, (
        served
    )


def test_full_weight_loads_and_plain_tensors_are_refused(lora_engine):
    from relax.sglang.client import SGLangHTTPError

    with pytest.raises(SGLangHTTPError, match="serves trainer.lora adapters"):
        lora_engine.update_weights_from_disk("/nonexistent", 9)
    with pytest.raises(ValueError, match=r"non-adapter tensors \['model.norm.weight'\]"):
        lora_engine.update_weights([("model.norm.weight", torch.ones(4))], 9)
    assert lora_engine.weight_version() != 9


def test_launch_flags_and_adapter_config():
    from relax.sglang.lora import adapter_config, server_args

    assert server_args(LORA, "cpu") == [
        "--enable-lora",
        "--max-lora-rank",
        "4",
        "--lora-target-modules",
        *LORA.target_modules,
        "--lora-backend",
        "torch_native",
    ]
    assert server_args(dataclasses.replace(LORA, target_modules=["all-linear"]), "cuda")[-1] == "all"
    config = adapter_config(LORA)
    assert config["r"] == config["lora_alpha"] == 4  # lora_B arrives scaled by alpha / rank already


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            ["trainer.lora.modules_to_save=[lm_head]"],
            "trainer.lora.modules_to_save: rollout.engine sglang serves adapters only",
        ),
        (
            ["trainer.lora.target_modules=[embed_tokens]"],
            r"trainer.lora.target_modules: SGLang cannot adapt \['embed_tokens'\]",
        ),
        (
            ["weight_sync.transport=sglang_distributed"],
            "weight_sync.transport: sglang_distributed writes full weights",
        ),
        (
            ["rollout.engine_params.pause_mode=in_place"],
            "rollout.engine_params.pause_mode: in_place keeps requests",
        ),
    ],
)
def test_what_sglang_cannot_serve_is_refused_at_validation_naming_the_field(overrides, field):
    from relax.core.config import ConfigError, load_config

    run = ["rollout.engine=sglang", "rollout.engine_params.python=/env/bin/python", "trainer.lora.rank=8"]
    assert load_config(None, run).trainer.lora.rank == 8  # the defaults are served
    assert load_config(
        None, [*run, "rollout.partial_rollout=abort", "rollout.engine_params.pause_mode=in_place"]
    )
    with pytest.raises(ConfigError, match=field):
        load_config(None, [*run, *overrides])
