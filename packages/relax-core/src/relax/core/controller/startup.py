"""Start-up: the driver's own preparation alongside Ray's start, and where the seconds went.

``relax run`` spends most of its first seconds waiting: for Ray's daemons, then for the role
actors to import torch and load their models. The driver's share (quick-start model on first use,
tokenizer, dataset) needs no Ray, so :class:`BackgroundSetup` runs it in a thread while
``ray.init`` waits; ``relax run`` goes further with :class:`EarlyStart`: Ray starts in a thread
before the config is loaded (loading it imports torch and the plugins), the role actors as soon
as it is. :class:`StartupClock` records named
phases from the process launch and prints one line before the first step, e.g. ``relax: first
step 9.8 s after launch: python + imports 2.1 | ray 4.3 | model, tokenizer, data 1.2 (alongside) |
setup beyond ray 0.0 | roles 3.1 | ready 0.1`` (with an early start, ray and roles show as
"(alongside)" plus the driver's "waiting for ..." time).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("relax")


def process_start_time() -> float | None:
    """Wall-clock time this process was launched (Linux ``/proc``), or None where unknown."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class StartupClock:
    """Named phases since ``launched`` (the process's launch, ``relax run``) or else since the clock was made
    (a ``run()`` call from a longer-lived process: its earlier work is not start-up); ``overlapped`` phases ran
    alongside another and are shown apart."""

    def __init__(self, launched: float | None = None):
        now = time.time()
        self.since = "launch" if launched else "run()"
        self.launched = launched or now
        self.last = self.launched
        self.phases: list[tuple[str, float, bool]] = []
        self.reported = False

    def mark(self, name: str) -> None:
        """The phase ``name`` ended now (it began where the previous phase ended)."""
        now = time.time()
        self.phases.append((name, now - self.last, False))
        self.last = now

    def add_overlapped(self, name: str, seconds: float) -> None:
        self.phases.append((name, seconds, True))

    def summary(self) -> str:
        parts = [f"{name} {s:.1f}" + (" (alongside)" if side else "") for name, s, side in self.phases]
        return f"first step {time.time() - self.launched:.1f} s after {self.since}: " + " | ".join(parts)

    def report(self) -> None:
        self.reported = True
        line = self.summary()
        log.info("relax: %s", line)
        print(f"relax: {line}", flush=True)


@dataclass
class LocalSetup:
    """What the driver prepares without Ray: model path, tokenizer and its ids, dataset."""

    model_path: str
    tokenizer: Any
    pad_id: int
    stop_token_ids: list[int]
    dataset: Any
    seconds: float


def prepare_local(cfg: Any) -> LocalSetup:
    """Model path (the quick-start model is built on first use), tokenizer, stop ids and dataset."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from relax.core.controller import runtime
    from relax.core.engines.stop_tokens import stop_token_ids  # EOS + chat-template end ids, never <unk>

    started = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = runtime.resolve_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = runtime.build_dataset(cfg, tokenizer, runtime.resolve_data_path(cfg, run_dir), model_path)
    return LocalSetup(
        model_path, tokenizer, pad_id, stop_token_ids(tokenizer), dataset, time.perf_counter() - started
    )


class BackgroundSetup:
    """:func:`prepare_local` in a thread, taken once (a restarted attempt prepares afresh)."""

    def __init__(self, cfg: Any):
        # transformers is imported here, not first in the thread: while the roles' thread imports it too,
        # CPython can hand one importer a partially initialised module to break a cross-thread import
        # cycle ("cannot import name 'AutoTokenizer'": test_multinode_cli.py, run alone)
        from transformers import AutoTokenizer  # noqa: F401

        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-setup")
        self._future: cf.Future | None = self._pool.submit(prepare_local, cfg)
        self._pool.shutdown(wait=False)

    def take(self, cfg: Any) -> LocalSetup:
        """The background result (its exception re-raised here), or a fresh one after the first take."""
        future, self._future = self._future, None
        return future.result() if future is not None else prepare_local(cfg)


class EarlyStart:
    """``relax run``'s head start: Ray, then the role actors, started in a thread while the driver
    still imports its libraries and prepares tokenizer and data.

    :meth:`before_config` starts Ray from the config file's ``ray:`` section alone, before the
    config (and with it torch and the plugins) is even loaded; :meth:`configure` then hands the
    loaded config over, and the roles start. A Ray that does not match what the loaded config needs
    (more CPUs reserved than the machine has, say) is restarted; a config that fails to load shuts
    it down (:meth:`abandon`). ``EarlyStart(cfg)`` is both steps at once.

    The thread stays parked until :meth:`release` (after Ray's shutdown): Ray's daemons are started
    with a parent-death signal, which Linux sends when the *thread* that started them exits.
    """

    def __init__(self, cfg: Any = None, *, ray_settings: Any = None):
        if ray_settings is None:
            from relax.core.controller.runtime import ray_settings as settings_for

            ray_settings = settings_for(cfg)
        self.seconds: dict[str, float] = {}
        self._settings = ray_settings
        self._cfg: cf.Future = cf.Future()
        self._ray: cf.Future = cf.Future()
        self._roles: cf.Future = cf.Future()
        self._taken = False
        self._park = threading.Event()
        self._thread = threading.Thread(target=self._start, name="relax-early-start", daemon=True)
        self._thread.start()
        if cfg is not None:
            self.configure(cfg)

    @classmethod
    def before_config(cls, path: str | None, overrides: list[str]) -> EarlyStart | None:
        """Start Ray from the file's ``ray:`` section; None where it cannot be read (the loader says
        why) or where the run may need no Ray (``ray_start.may_run_in_driver``: the loaded config
        decides, and Ray starts after it if it does need one; until then ``import ray`` is deferred,
        see ``relax.core.lazy_ray``)."""
        from relax.core import lazy_ray
        from relax.core.controller.ray_start import may_run_in_driver, peek_config, peek_settings

        data = peek_config(path, overrides)
        settings = peek_settings(data)
        if settings is not None and may_run_in_driver(data):
            lazy_ray.defer_import()
            return None
        return None if settings is None else cls(ray_settings=settings)

    def configure(self, cfg: Any) -> None:
        """The loaded config: the roles start (after a restart of Ray if it needs another one)."""
        self._cfg.set_result(cfg)

    def abandon(self, timeout_s: float = 60.0) -> None:
        """The config did not load: shut down the Ray this start launched and end the thread."""
        self._cfg.set_exception(RuntimeError("the config did not load"))
        self._park.set()
        self._thread.join(timeout_s)

    def _start(self) -> None:
        from relax.core.controller import ray_start

        try:
            started = time.perf_counter()
            launched = ray_start.start_ray(self._settings)
            self.seconds["ray"] = time.perf_counter() - started
            try:
                cfg = self._cfg.result()
            except RuntimeError:  # abandoned
                if launched:
                    import ray

                    ray.shutdown()
                return
            from relax.core.controller import runtime

            needed = runtime.ray_settings(cfg)
            if launched and needed != self._settings:  # guessed wrong: start the Ray this config needs
                log.info("relax: restarting Ray: the config needs %s, not %s", needed, self._settings)
                import ray

                ray.shutdown()
                started = time.perf_counter()
                ray_start.start_ray(needed)
                self.seconds["ray"] += time.perf_counter() - started
            self._ray.set_result(launched)
        except BaseException as exc:  # delivered to ray() and take_roles()
            self._ray.set_exception(exc)
            return
        try:
            started = time.perf_counter()
            self._roles.set_result(runtime.start_roles(cfg, runtime.resolve_model_path(cfg)))
            self.seconds["roles"] = time.perf_counter() - started
        except BaseException as exc:
            self._roles.set_exception(exc)
        self._park.wait()

    def ray(self) -> bool:
        """Wait for Ray; True if this start launched an embedded Ray (its error re-raised here)."""
        return self._ray.result()

    def take_roles(self) -> Any | None:
        """The started roles (their start-up error re-raised here) the first time; then None, so a
        restarted attempt starts its own."""
        taken, self._taken = self._taken, True
        if taken or self._ray.exception() is not None:  # a failed Ray start is raised by ray()
            return None
        return self._roles.result()

    def release(self) -> None:
        """Let the thread end (call after Ray's shutdown)."""
        self._park.set()
