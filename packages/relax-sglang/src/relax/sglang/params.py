"""``rollout.engine_params`` of the ``sglang`` engine (typed, validated by core's config loader)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

PauseMode = Literal["retract", "in_place", "abort"]
Router = Literal["relax", "sglang"]


@dataclass(frozen=True)
class SGLangEngineParams:
    """Launch one SGLang server per engine index, or attach to running ones (``urls``).

    ``python`` is the interpreter of the server's environment (SGLang pins its own torch and
    transformers, so it cannot share Relax's venv; ``scripts/build_server_env.sh`` builds one for CPU).
    ``pause_mode`` is what ``pause()`` does to requests in flight when ``rollout.partial_rollout`` is
    ``in_place``: ``retract`` (back to the queue, recomputed under the new weights), ``in_place`` (kept with
    their KV cache) or ``abort`` (ended, then resubmitted by the engine as a continuation). Either way a
    sequence that spans a weight update reports both versions, token by token.
    """

    urls: list[str] = field(default_factory=list)  # attach: engine i uses urls[i % len(urls)]; empty: launch
    python: str = "python"  # the server environment's interpreter; "auto": build/reuse the cached CPU env
    device: str = "cpu"
    # None below: the device's default (relax.sglang.device_defaults; docs/gpu.md has the table)
    dtype: str | None = None  # cpu: the run's model dtype; cuda: the run's when not float32, else bfloat16
    mem_fraction_static: float = (
        0.8  # SGLang's static memory fraction (the KV pool is capped by max_total_tokens)
    )
    max_total_tokens: int | None = None  # cpu: 4096; cuda: SGLang sizes the KV pool; 0: no cap on either
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port per engine
    # --enable-deterministic-inference, the only mode that honours request seeds: cpu on, cuda off (slower kernels)
    deterministic: bool | None = None
    # on CUDA: --enable-memory-saver --enable-weights-cpu-backup, so rollout.release_memory can free the GPU
    # (weights and KV cache) and resume_memory restores the weights even where a sync rewrites only some
    memory_saver: bool = True
    extra_args: list[str] = field(default_factory=list)  # passed through to sglang.launch_server
    # frames per second of video requests (= relax-omni's data.processor_params.fps); a launched video model's
    # server samples at it (--mm-process-config, see relax.sglang.media), an attached one must too
    video_fps: float = 2.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the server process
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0  # one /generate call
    control_timeout_s: float = 120.0  # health, pause, weight updates
    max_concurrency: int | None = None  # /generate calls in flight per engine; cpu: 64, cuda: 1024
    pause_mode: PauseMode = "retract"
    num_cpus: float = 1.0  # reserved per engine (the server's own processes are not counted)
    # "relax": one server per engine, core's router balances engines. "sglang": this engine runs `servers`
    # servers (attached: every url of `urls`) behind one sglang-router (relax.sglang.router): cache-aware
    # routing of /generate, control calls to every server. Use rollout.num_engines 1 to route a whole fleet.
    router: Router = "relax"
    servers: int = 1  # launched servers behind the engine's sglang-router (router: sglang)
    router_python: str = (
        "auto"  # an interpreter with sglang-router; auto: $RELAX_SGLANG_ROUTER_PYTHON, ours, the server's
    )
    router_policy: str = (
        "cache_aware"  # sglang-router --policy (random, round_robin, cache_aware, power_of_two)
    )
    router_args: list[str] = field(default_factory=list)  # passed through to sglang_router.launch_router

    def memory_layout(self, cfg: Any) -> Any:
        """The memory plan's view of one engine (``relax.core.memory_plan``): ``servers`` x ``tp_size`` GPUs, each
        taking ``mem_fraction_static`` of its memory for weights / TP + KV cache, plus CUDA graphs and activations
        outside that pool; None on CPU or when attached to servers Relax does not launch."""
        if not self.device.startswith("cuda") or self.urls:
            return None
        from relax.core.memory_plan import EngineLayout

        # device_defaults.default_dtype's CUDA rule (that module imports this one): bf16 unless the run is half
        dtype = self.dtype or (cfg.model.dtype if cfg.model.dtype != "float32" else "bfloat16")
        return EngineLayout(
            gpus=self.tp_size * self.servers,
            tensor_parallel=self.tp_size,
            weight_bytes=4 if dtype in ("float32", "fp32") else 2,
            static_fraction=self.mem_fraction_static,
            kv_cap_tokens=self.max_total_tokens or None,
            runtime_gib=3.0,
            releases_memory=cfg.rollout.release_memory and self.memory_saver,
            note=f"sglang tp {self.tp_size}, mem_fraction_static {self.mem_fraction_static}",
        )

    def validate_run(self, cfg: Any) -> list[str]:
        """Checks against the whole run (core's ``validate_run``): what of ``trainer.lora`` SGLang cannot serve."""
        lora = getattr(cfg.trainer, "lora", None)
        if lora is None:
            return []
        from relax.sglang.lora import validate

        errors = validate(lora, cfg.weight_sync.transport)
        if self.pause_mode == "in_place" and cfg.rollout.partial_rollout == "in_place":
            errors.append(
                "rollout.engine_params.pause_mode: in_place keeps requests on the adapter they started "
                "with (SGLang cannot switch a running request's adapter); with trainer.lora use retract or "
                "abort (both resubmit under the new adapter)"
            )
        return errors

    def validate(self) -> list[str]:
        errors = []
        for name in (
            "startup_timeout_s",
            "request_timeout_s",
            "control_timeout_s",
            "mem_fraction_static",
            "video_fps",
        ):
            if getattr(self, name) <= 0:
                errors.append(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            errors.append(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.max_total_tokens is not None and self.max_total_tokens < 0:
            errors.append(f"max_total_tokens: must be >= 0 (0: no cap), got {self.max_total_tokens}")
        if self.tp_size < 1:
            errors.append(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.tp_size > 1 and self.device == "cpu":
            errors.append("tp_size: SGLang tensor parallelism needs GPUs; use tp_size 1 with device 'cpu'")
        if self.servers < 1:
            errors.append(f"servers: must be >= 1, got {self.servers}")
        if self.servers > 1 and self.router != "sglang":
            errors.append(
                "servers: several servers per engine need router 'sglang' (with router 'relax' each "
                "engine is one server: raise rollout.num_engines instead)"
            )
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            errors.append(f"urls: must start with http:// or https://, got {bad}")
        return errors
