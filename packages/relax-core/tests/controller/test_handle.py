"""RunControl: requests from any thread are applied by the driver between steps; pause blocks the
loop until resume while still serving requests; requests left at the end fail with a reason."""

from __future__ import annotations

import threading
import time

import pytest

from relax.core.controller.handle import RunControl, RunHandle


class FakeState:
    """The slice of RunState that control requests touch (recorded, not simulated)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.cfg, self.run_dir, self.step, self.version, self.last_metrics = "cfg", "dir", 3, 2, {"a": 1.0}

    def save_checkpoint(self):
        self.calls.append("checkpoint")
        return f"ckpt-{self.step}"

    def add_engine(self):
        self.calls.append("add")
        return 7

    def remove_engine(self, index):
        if index == 99:
            raise KeyError(f"no engine {index}")
        self.calls.append(f"remove {index}")


def test_requests_apply_in_order_between_steps():
    control, state = RunControl(), FakeState()
    ckpt, add, bad = control.request_checkpoint(), control.add_engine(), control.remove_engine(99)
    assert not ckpt.done()  # nothing happens until the driver applies
    control.apply(state)
    assert state.calls == ["checkpoint", "add"]
    assert ckpt.result(0) == "ckpt-3" and add.result(0) == 7
    with pytest.raises(KeyError, match="no engine 99"):
        bad.result(0)


def test_pause_blocks_the_loop_until_resume_and_still_serves_requests():
    control, state = RunControl(), FakeState()
    control.pause()
    finished = threading.Event()
    thread = threading.Thread(target=lambda: (control.apply(state, poll_s=0.05), finished.set()))
    thread.start()
    time.sleep(0.3)
    assert control.paused and not finished.is_set()
    assert control.remove_engine(1).result(timeout=5) is None  # served while paused
    assert not finished.is_set()
    control.resume()
    assert finished.wait(5)
    assert state.calls == ["remove 1"]


def test_pending_requests_fail_when_the_run_ends_and_the_handle_is_read_only():
    control, state = RunControl(), FakeState()
    future = control.add_engine()
    control.cancel_pending("failed")
    with pytest.raises(RuntimeError, match="add_engine not applied: failed"):
        future.result(0)
    handle = RunHandle(state, control)
    assert (handle.config, handle.run_dir, handle.step, handle.weight_version) == ("cfg", "dir", 3, 2)
    snapshot = handle.metrics
    snapshot["a"] = 5.0
    assert handle.metrics == {"a": 1.0}
    with pytest.raises(AttributeError):
        handle.step = 4
