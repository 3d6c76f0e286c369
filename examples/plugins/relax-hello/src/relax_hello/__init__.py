"""relax-hello: the example plugin of docs/plugins.md (each module there is quoted in full)."""

from relax_hello.command import relax_register_commands
from relax_hello.engine import relax_register_rollout_engines
from relax_hello.hooks import relax_on_run_end
from relax_hello.reward import relax_register_rewards
from relax_hello.trainer import relax_register_trainers
from relax_hello.transport import relax_register_weight_syncs

__all__ = [
    "relax_on_run_end",
    "relax_register_commands",
    "relax_register_rewards",
    "relax_register_rollout_engines",
    "relax_register_trainers",
    "relax_register_weight_syncs",
]
