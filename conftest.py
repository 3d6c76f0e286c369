"""Suite-wide test setup: offline, quiet Ray; one local Ray instance per pytest session."""

from __future__ import annotations

import os

for _key, _value in {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

if (
    "RELAX_CACHE_DIR" not in os.environ
):  # built models and data for this session only: a home directory's cache
    import atexit  # from an earlier run (or another version) never decides what a test sees
    import shutil
    import tempfile

    os.environ["RELAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="relax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["RELAX_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray instance shared by the whole session (``ray.init`` twice would raise)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={
                "env_vars": {
                    k: os.environ[k]
                    for k in (
                        "RAY_AUTH_MODE",
                        "HF_HUB_OFFLINE",
                        "OMP_NUM_THREADS",
                        "WANDB_MODE",
                        "RELAX_CACHE_DIR",
                    )
                }
            },
        )
    yield ray


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test starts with the suite's torch thread count (OMP_NUM_THREADS above, 1). A run whose roles live
    in the driver (``rollout.host: driver``) sets the driver process's torch threads and OMP_NUM_THREADS to
    every core (roles._limit_threads) and leaves them so: later tests then summed in another order, and
    test_omni.py's megatron-vs-transformers logprobs came out 1.03e-5 apart (1e-5 allowed) only in a full run."""
    import sys

    before = os.environ.get("OMP_NUM_THREADS")
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before
    torch = sys.modules.get("torch")  # never imported here: tests that do not use torch stay free of it
    if torch is not None and before and before.isdigit() and torch.get_num_threads() != int(before):
        torch.set_num_threads(int(before))


def _located(tb):
    """``tb``'s chain with every entry that has no line number given its function's first line instead."""
    import types

    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    out = None
    for entry in reversed(entries):
        line = entry.tb_lineno if entry.tb_lineno is not None else entry.tb_frame.f_code.co_firstlineno
        out = types.TracebackType(out, entry.tb_frame, entry.tb_lasti, line)
    return out


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure whose traceback has a frame without a line number (Python 3.11 gives ``tb_lineno`` None for an
    exception passing an instruction with no location, e.g. an exception handler's cleanup code) made pytest's
    own formatter raise ``TypeError`` (``tb_lineno - 1``): an INTERNALERROR that ended the session with the
    failure and the durations unprinted (a clean run, integration_tests/test_omni_examples.py). Such a failure
    is reported with those frames placed at their function's first line."""
    try:
        return (yield)
    except TypeError as error:
        if call.excinfo is None or "NoneType" not in str(error):
            raise
        from _pytest._code import ExceptionInfo
        from _pytest.reports import TestReport

        seen, todo = set(), [call.excinfo.value]
        while todo:  # the exception and those it was raised from / during
            exc = todo.pop()
            if exc is not None and id(exc) not in seen:
                seen.add(id(exc))
                exc.__traceback__ = _located(exc.__traceback__)
                todo += [exc.__cause__, exc.__context__]
        call.excinfo = ExceptionInfo.from_exception(call.excinfo.value)
        return TestReport.from_item_and_call(item, call)
