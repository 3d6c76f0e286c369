"""The driver's signal guard and the process reaper, with real signals and real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from relax.core.controller import signals
from relax.core.controller.recovery import reason
from relax.core.controller.teardown import alive, descendants, reap


def test_first_signal_interrupts_second_skips_the_checkpoint_later_ones_never_interrupt(capsys):
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest was started in the background by a shell
    with signals.guarded() as guard:
        with pytest.raises(signals.Interrupted) as err:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        assert err.value.signame == "SIGTERM" and reason(err.value) == "interrupted by SIGTERM"
        with pytest.raises(signals.Interrupted), signals.phase("checkpoint"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert guard.skip_checkpoint
        with signals.phase("cleanup"):
            os.kill(os.getpid(), signal.SIGINT)  # must not raise: cleanup runs to the end
            time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is before  # restored
    err_text = capsys.readouterr().err
    assert "SIGTERM received: stopping" in err_text
    assert "skipping the emergency checkpoint" in err_text
    assert "still shutting Ray down cleanly" in err_text


def test_reap_kills_descendants_that_outlive_the_grace_period_even_stopped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        found = descendants(os.getpid())
        assert child.pid in found
        started = time.monotonic()
        killed = reap({child.pid: found[child.pid]}, grace_s=0.3)
        assert killed == [child.pid] and time.monotonic() - started < 5
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert not alive({child.pid: found[child.pid]})
    finally:
        if child.poll() is None:
            child.kill()
