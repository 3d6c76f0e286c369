from dataclasses import dataclass

from relax.core.hookspecs import hookimpl


@dataclass(frozen=True)
class LengthParams:  # reward.params, checked by `relax validate`
    target: int = 4


class LengthReward:
    def __init__(self, params: LengthParams, ctx):
        self.target = params.target

    async def score(self, sample):
        return -abs(len(sample.response_ids) - self.target) / self.target


@hookimpl
def relax_register_rewards(register):
    register("length", LengthReward, config=LengthParams)
