"""Multi-turn rollouts: a sample is an episode of policy turns and environment observations.

Token in, token out: the trajectory the trainer sees is the token ids the engine sampled, turn by
turn, with each observation's tokens (rendered by the chat template as a continuation, never by
re-tokenising the conversation) between them at loss mask 0 and logprob 0. The router
(``relax.core.controller.router.stream_groups``) asks :class:`Turns` for each request and hands
it each result; :class:`Turns` steps the episodes and says which samples need another turn.
"""

from relax.core.agentic.bounded import EpisodeTimeout
from relax.core.agentic.render import ObservationRenderer
from relax.core.agentic.turns import EpisodeLimits, NoToolCalls, Turns

__all__ = ["EpisodeLimits", "EpisodeTimeout", "NoToolCalls", "ObservationRenderer", "Turns"]
