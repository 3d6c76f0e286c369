"""The run's transport as start-up builds it: a hosted engine bypasses the configured transport and
the log says so once (naming the transport and why), and a plugin transport is
checked against ``protocols.WeightSync`` -- a missing method is named at start-up, not at the end."""

from __future__ import annotations

import logging

import pytest

from relax.core import plugins
from relax.core.config import load_config
from relax.core.controller.runtime import build_weight_sync
from relax.core.plugins import RelaxPluginManager
from relax.core.weight_sync.hosted import HostedSync


def test_a_hosted_engine_bypasses_the_chosen_transport_and_says_so_once(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="relax")
    cfg = load_config(None, [f"run_dir={tmp_path}", "weight_sync.transport=disk", "rollout.host=trainer"])
    assert isinstance(build_weight_sync(cfg, str(tmp_path), hosted=True), HostedSync)
    (record,) = [r for r in caplog.records if "weight_sync.transport" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert "weight_sync.transport 'disk' is not used: rollout.host=trainer" in record.getMessage()
    assert "0 bytes move" in record.getMessage() and "rollout.host=separate" in record.getMessage()
    caplog.clear()
    build_weight_sync(
        load_config(None, [f"run_dir={tmp_path}", "rollout.host=separate"]), str(tmp_path), hosted=False
    )
    assert not [r for r in caplog.records if "is not used" in r.getMessage()]  # used: nothing to say


class NoClose:
    def __init__(self, params=None, ctx=None):
        pass

    def sync(self, trainer, engines, version):
        return {}

    def check_engine(self, engine):
        pass


class NoClosePlugin:
    def relax_register_weight_syncs(self, register):
        register("no_close", NoClose)


def test_a_transport_missing_a_protocol_method_is_named_at_start_up(monkeypatch, tmp_path):
    monkeypatch.setattr(plugins, "_MANAGER", RelaxPluginManager(extra_plugins={"noclose": NoClosePlugin()}))
    cfg = load_config(
        None,
        [f"run_dir={tmp_path}", "weight_sync.transport=no_close", "rollout.host=separate"],
        check_plugins=False,
    )
    with pytest.raises(
        TypeError, match=r"weight_sync.transport 'no_close': NoClose is not a WeightSync .* lacks close"
    ):
        build_weight_sync(cfg, str(tmp_path), hosted=False)
