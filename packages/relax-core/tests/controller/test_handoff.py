"""The colocate memory handoff (``controller.handoff``): one step's phases in order -- engines release, trainer
onload, train, trainer release, engines resume, sync, trainer offload -- with the trainer's state really where
each phase says (a real torch trainer behind the trainer role, in this process), and ``trainer.offload``
refused where it means nothing, with the field and the reason named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from relax.core.config import ConfigError, load_config
from relax.core.controller import capabilities
from relax.core.controller.contexts import trainer_context
from relax.core.controller.handoff import Handoff
from relax.core.controller.hosting import placement_errors
from relax.core.controller.roles import TrainerRole
from relax.core.lazy_ray import LocalHandle
from relax.core.quickstart_model import ensure_quickstart_model
from relax.core.testing import make_batch, make_samples

OFFLOAD = ["trainer.offload=true", "rollout.host=separate", "rollout.release_memory=true"]


class RecordingFleet:
    """Stand-in for the engine fleet (the order is the controller's, not an engine's): records each control call
    and sync with where the trainer's state is at that moment."""

    def __init__(self, trainer, log: list) -> None:
        self.trainer, self.log = trainer, log
        self.router = SimpleNamespace(live=lambda: {0: "engine 0"})

    def _record(self, what: str) -> None:
        self.log.append((what, sorted(self.trainer.offloader.on_host)))

    def control(self, method: str, engines=None) -> dict:
        self._record(method)
        return {0: None}

    def sync(self, version: int) -> dict[str, float]:
        self._record("sync")
        return {}


def run_step(handoff: Handoff, fleet: RecordingFleet, role, batch, log: list) -> None:
    """What ``colocate.colocate_step`` does around the rollout, the update and the sync."""
    handoff.before_rollout()
    log.append(("rollout", sorted(fleet.trainer.offloader.on_host)))
    with handoff.training():
        log.append(("train", sorted(fleet.trainer.offloader.on_host)))
        role.train_step(dict(batch))
    fleet.sync(1)
    handoff.mark("sync")
    handoff.after_sync()


@pytest.fixture(scope="module")
def role():
    cfg = load_config(None, [*OFFLOAD, "trainer.micro_batch_size=4"])
    return TrainerRole.__ray_actor_class__(
        cfg, trainer_context(cfg, ensure_quickstart_model()), num_threads=1
    )


@pytest.fixture(scope="module")
def batch():
    tokenizer = AutoTokenizer.from_pretrained(ensure_quickstart_model())
    return make_batch(make_samples(tokenizer, rows=4, seed=5), tokenizer.pad_token_id)


def test_a_step_hands_the_device_over_in_order(role, batch):
    cfg, log, metrics = load_config(None, OFFLOAD), [], {}
    fleet = RecordingFleet(role.trainer, log)
    state = SimpleNamespace(cfg=cfg, roles=SimpleNamespace(trainer=LocalHandle(role)), fleet=fleet)
    handoff = Handoff(state, metrics)
    run_step(handoff, fleet, role, batch, log)
    assert handoff.phases == [
        "trainer_offload",
        "engines_release",
        "trainer_onload",
        "train",
        "trainer_release",
        "engines_resume",
        "sync",
        "trainer_offload",
    ]
    host, opt = ["optimizer", "params"], ["optimizer"]
    assert log == [
        ("rollout", host),
        ("release_memory", host),
        ("train", []),
        ("resume_memory", opt),
        ("sync", opt),
    ]
    assert role.trainer.offloader.on_host == set(host)
    phases = ("before_rollout", "before_train", "after_update", "after_release", "after_offload")
    assert {f"perf/rss_{p}_gb" for p in phases} <= set(metrics)  # + perf/mem_<phase>_gb where CUDA runs
    assert {"time/release_memory_s", "time/onload_s", "time/trainer_release_s", "time/offload_s"} <= set(
        metrics
    )

    weights = role.trainer.model.state_dict()  # on the host now
    synced = dict(
        kv for bucket in role.export_weights(1 << 30) for kv in bucket
    )  # e.g. a replacement engine's sync
    assert synced and all(torch.equal(t, weights[n].to(t.dtype)) for n, t in synced.items())
    assert role.trainer.offloader.on_host == set(host)  # back on the host after the export

    again, log[:] = Handoff(state, {}), []  # the next step: the trainer is already off the device
    run_step(again, fleet, role, batch, log)
    assert again.phases[0] == "engines_release" and again.phases[-1] == "trainer_offload"
    assert log[:3] == [("rollout", host), ("release_memory", host), ("train", [])]


def test_without_offload_the_trainer_only_frees_its_cache(role, batch):
    cfg, log, metrics = load_config(None, ["rollout.host=separate"]), [], {}
    role.trainer.onload()
    fleet = RecordingFleet(role.trainer, log)
    handoff = Handoff(
        SimpleNamespace(cfg=cfg, roles=SimpleNamespace(trainer=LocalHandle(role)), fleet=fleet), metrics
    )
    run_step(handoff, fleet, role, batch, log)
    assert handoff.phases == ["train", "trainer_release", "sync"]
    assert log == [
        ("rollout", []),
        ("train", []),
        ("sync", []),
    ]  # nothing moved, the engines kept their memory
    assert {"perf/rss_after_update_gb", "perf/rss_after_release_gb"} <= set(metrics)
    assert role.trainer.offloader.on_host == set()


def test_a_failed_update_still_gives_the_engines_their_memory_back(role, batch):
    cfg, log = load_config(None, OFFLOAD), []
    fleet = RecordingFleet(role.trainer, log)
    handoff = Handoff(
        SimpleNamespace(cfg=cfg, roles=SimpleNamespace(trainer=LocalHandle(role)), fleet=fleet), {}
    )
    with pytest.raises(RuntimeError, match="the update failed"), handoff.training():
        raise RuntimeError("the update failed")
    assert [what for what, _ in log] == ["release_memory", "resume_memory"]
    assert handoff.phases == ["engines_release", "trainer_onload"]


def test_offload_is_refused_where_it_means_nothing():
    with pytest.raises(ConfigError, match=r"trainer.offload: supported in mode 'colocate' only"):
        load_config(None, ["trainer.offload=true", "mode=async", "max_staleness=1"])
    hosted = placement_errors(load_config(None, ["trainer.offload=true"]))  # the quick-start hosts its engine
    assert (
        hosted
        and "rollout.host 'auto': in the driver" in hosted[0]
        and "set rollout.host: separate" in hosted[0]
    )
    assert placement_errors(load_config(None, OFFLOAD)) == []
    with pytest.raises(
        ConfigError, match=r"trainer.offload with trainer.backend_params.cpu_offload: .* already live"
    ):
        load_config(
            None,
            [*OFFLOAD, "trainer.backend=fsdp", "trainer.backend_params={device: cuda, cpu_offload: true}"],
        )
    need = capabilities.required(load_config(None, OFFLOAD))["trainer"]
    assert need["offload"] == need["onload"] == "trainer.offload"
    with pytest.raises(capabilities.CapabilityError, match=r"'plain' does not implement offload\(\)"):
        capabilities.check(load_config(None, OFFLOAD), {"trainer": ("plain", ["save_hf"])})
