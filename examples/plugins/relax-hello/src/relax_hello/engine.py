from dataclasses import dataclass

from relax.core.context import Resources
from relax.core.engines.hf import HFRolloutEngine
from relax.core.hookspecs import hookimpl


@dataclass(frozen=True)
class CountingParams:  # rollout.engine_params
    max_batch_size: int = 64
    num_cpus: float = 1.0


class CountingEngine:
    """The built-in HF engine, composed (not inherited), counting the tokens it generates."""

    def __init__(self, params: CountingParams, ctx):
        self.inner = HFRolloutEngine(ctx.model_path, dtype=ctx.dtype, max_batch_size=params.max_batch_size)
        self.index, self.tokens = ctx.index, 0

    async def generate(self, requests):
        results = await self.inner.generate(requests)
        self.tokens += sum(len(r.response_ids) for r in results)
        return results

    def update_weights(self, named_tensors, version):
        self.inner.update_weights(named_tensors, version)

    def weight_version(self):
        return self.inner.weight_version()

    def pause(self):
        self.inner.pause()

    def resume(self):
        self.inner.resume()

    def abort(self):  # optional capability: declared by having it
        self.inner.abort()

    def health(self):
        return {**self.inner.health(), "engine": self.index, "tokens_generated": self.tokens}


@hookimpl
def relax_register_rollout_engines(register):
    register(
        "counting", CountingEngine, config=CountingParams, resources=lambda p: Resources(num_cpus=p.num_cpus)
    )
