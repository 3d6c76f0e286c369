"""Core's built-in plugin: registers the CPU backends through the same hooks as any plugin.

Factories import their modules lazily so that ``relax plugins`` stays fast. Each backend's typed
config section is a small dataclass here, next to its registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from relax.core.context import PluginContext, Resources
from relax.core.hookspecs import hookimpl
from relax.core.trainers.fsdp.params import FSDPParams


@dataclass(frozen=True)
class HFEngineParams:
    """``rollout.engine_params`` of the ``hf`` engine."""

    device: str = "cpu"
    max_batch_size: int = 256  # requests decoded together; longer lists run in chunks
    seed: int = 0  # draws seeds for requests that carry none
    num_cpus: float = 1.0  # reserved per engine
    # finished requests' KV kept for requests continuing them (multi-turn turns); 0: none (engines.prefix_cache)
    prefix_cache_mb: float = 256.0

    def validate(self) -> list[str]:  # num_cpus >= 0 is checked for every section by relax.core.checks
        errors = (
            [] if self.max_batch_size >= 1 else [f"max_batch_size: must be >= 1, got {self.max_batch_size}"]
        )
        return errors + (
            [f"prefix_cache_mb: must be >= 0, got {self.prefix_cache_mb}"] if self.prefix_cache_mb < 0 else []
        )


@dataclass(frozen=True)
class TorchTrainerParams:
    """``trainer.backend_params`` of the ``torch`` trainer."""

    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # None: model.dtype
    world_size: int = 1  # data-parallel ranks (gloo on CPU, NCCL on GPU), each a Ray actor
    num_cpus: float = 1.0  # reserved per rank
    # VL / Omni models: keep the vision / audio towers as loaded (not trained, not sent in weight syncs):
    # both (a model without towers is no error), or one kind (a model without that tower is an error)
    freeze_media_towers: bool = False
    freeze_vision: bool = False
    freeze_audio: bool = False

    def validate(self) -> list[str]:
        return [] if self.world_size >= 1 else [f"world_size: must be >= 1, got {self.world_size}"]

    def validate_run(self, cfg: Any) -> list[str]:
        """What the trainer would refuse at start-up (any world_size trains a critic: data-parallel replicas)."""
        from relax.core.trainers.recompute import recompute_problem

        problem = recompute_problem(cfg.trainer.recompute)
        return [problem] if problem else []


@dataclass(frozen=True)
class NumericRewardParams:
    mode: Literal["first", "last", "answer"] = "first"  # which number in the response is the answer
    abs_tol: float = 1e-6
    rel_tol: float = 0.0


@dataclass(frozen=True)
class ExactMatchRewardParams:
    case_sensitive: bool = False


def _hf_engine(params: HFEngineParams, ctx: PluginContext):
    from relax.core.engines.hf import HFRolloutEngine

    return HFRolloutEngine(
        ctx.model_path,
        dtype=ctx.dtype,
        device=params.device,
        max_batch_size=params.max_batch_size,
        seed=params.seed,
        prefix_cache_mb=params.prefix_cache_mb,
        record_routing=ctx.record_routing,
    )


def _torch_trainer(params: TorchTrainerParams, ctx: PluginContext):
    from relax.core.trainers.torch_trainer import trainer_from_context

    return trainer_from_context(params, ctx)


def _fsdp_trainer(params: FSDPParams, ctx: PluginContext):
    from relax.core.trainers.fsdp.trainer import trainer_from_context

    return trainer_from_context(params, ctx)


def _numeric_reward(params: NumericRewardParams, ctx: PluginContext):
    from relax.core.rewards.numeric import NumericReward

    return NumericReward(mode=params.mode, abs_tol=params.abs_tol, rel_tol=params.rel_tol)


def _exact_match_reward(params: ExactMatchRewardParams, ctx: PluginContext):
    from relax.core.rewards.exact_match import ExactMatchReward

    return ExactMatchReward(case_sensitive=params.case_sensitive)


def _device_resources(params: HFEngineParams | TorchTrainerParams | FSDPParams) -> Resources:
    """One GPU per engine / trainer rank when the backend runs on CUDA."""
    return Resources(num_cpus=params.num_cpus, num_gpus=1.0 if params.device.startswith("cuda") else 0.0)


@hookimpl
def relax_register_rollout_engines(register):
    register("hf", _hf_engine, config=HFEngineParams, resources=_device_resources)


@hookimpl
def relax_register_trainers(register):
    register(
        "torch",
        _torch_trainer,
        config=TorchTrainerParams,
        resources=lambda p: Resources(p.num_cpus, _device_resources(p).num_gpus, num_workers=p.world_size),
    )
    register(
        "fsdp",
        _fsdp_trainer,
        config=FSDPParams,
        resources=lambda p: Resources(p.num_cpus, _device_resources(p).num_gpus, num_workers=p.world_size),
    )


def _fsdp_to_hf(checkpoint: str, hf_dir: str) -> int:
    from relax.core.trainers.fsdp.state import to_hf

    return to_hf(checkpoint, hf_dir)


def _is_fsdp_checkpoint(path: Any) -> bool:
    from relax.core.trainers.fsdp.state import is_checkpoint

    return is_checkpoint(path)


@hookimpl
def relax_register_checkpoint_formats(register):
    register("fsdp", _fsdp_to_hf, detect=_is_fsdp_checkpoint)


@hookimpl
def relax_register_rewards(register):
    # pure-Python rule rewards: cheap enough to score in the driver (no reward actor, maybe no Ray)
    register("numeric", _numeric_reward, config=NumericRewardParams, in_driver=True)
    register("exact_match", _exact_match_reward, config=ExactMatchRewardParams, in_driver=True)
    register("environment", _environment_reward, config=EnvironmentRewardParams, in_driver=True)


@dataclass(frozen=True)
class EnvironmentRewardParams:
    """``reward.params`` of the ``environment`` reward."""

    missing_score: float = 0.0  # an episode that ended without a reward (error, timeout, limit)


def _environment_reward(params: EnvironmentRewardParams, ctx: PluginContext) -> Any:
    from relax.core.rewards.environment import EnvironmentReward

    return EnvironmentReward(params.missing_score)


@hookimpl
def relax_register_tool_parsers(register):
    from relax.core.agentic import NoToolCalls

    register("none", lambda params, ctx: NoToolCalls())


@hookimpl
def relax_register_processors(register):
    from relax.core.processors import TextProcessorParams, text_processor

    register("text", text_processor, config=TextProcessorParams)


@hookimpl
def relax_register_algorithms(register):
    from relax.core.algorithms import register_builtin_algorithms

    register_builtin_algorithms(register)


@hookimpl
def relax_register_weight_syncs(register):
    from relax.core.weight_sync import register_builtin_weight_syncs

    register_builtin_weight_syncs(register)


@hookimpl
def relax_register_queues(register):
    from relax.core.queue import register_builtin_queues

    register_builtin_queues(register)


@hookimpl
def relax_register_inputs(register):
    from relax.core.smollm2 import (
        register_smollm2_inputs,
    )  # a real pretrained model (examples/smollm2_eval.yaml)

    register_smollm2_inputs(register)


# the control plane's hooks: notifications (logging.notify_urls), the REST API when control.enabled,
# and its client subcommands (relax status, engines, scale-out, ...); Serve/Apprise load only when used
from relax.core.control.plugin import (  # noqa: E402,F401
    relax_on_run_end,
    relax_on_run_start,
    relax_on_step_end,
    relax_register_commands,
)
