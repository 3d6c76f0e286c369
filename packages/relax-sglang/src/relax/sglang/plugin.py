"""relax-sglang plugin: the ``sglang`` rollout engine and its weight-sync transports (entry point
``sglang`` in the ``relax`` group). Registration is cheap; the engine module loads only when chosen."""

from __future__ import annotations

from relax.core.context import PluginContext, Resources
from relax.core.hookspecs import hookimpl
from relax.sglang.params import SGLangEngineParams


def _engine(params: SGLangEngineParams, ctx: PluginContext):
    from relax.sglang.engine import SGLangEngine

    return SGLangEngine(
        params,
        ctx.model_path,
        dtype=ctx.dtype,
        index=ctx.index,
        run_dir=ctx.run_dir,
        tokenizer_path=ctx.tokenizer_path,
        record_routing=ctx.record_routing,
        lora=ctx.lora,
    )


def _resources(params: SGLangEngineParams) -> Resources:
    """Attached servers cost the engine actor nothing but HTTP; launched ones hold ``tp_size`` GPUs each on
    CUDA (``servers`` of them behind an sglang-router)."""
    servers = params.servers if params.router == "sglang" else 1
    gpus = float(params.tp_size * servers) if params.device.startswith("cuda") and not params.urls else 0.0
    return Resources(num_cpus=params.num_cpus, num_gpus=gpus)


@hookimpl
def relax_register_rollout_engines(register):
    # attach="urls": core's scale-out by URL starts an engine with engine_params.urls = [that URL]
    register("sglang", _engine, config=SGLangEngineParams, resources=_resources, attach="urls")


@hookimpl
def relax_register_weight_syncs(register):
    from relax.sglang.transports import SGLangDiskSync, SGLangDistributedSync, SGLangTensorSync

    for cls in (SGLangDiskSync, SGLangTensorSync, SGLangDistributedSync):
        register(cls.name, cls, config=cls.config)
