"""Weight sync: move trainer weights to rollout engines under a version number, trainer → engines
directly (the driver only orchestrates; see ``transport``).

Built-in transports (``weight_sync.transport``, typed ``weight_sync.params``):

- ``in_process`` — :class:`InProcessSync`, direct calls (colocated trainer and engines, tests);
- ``object_store`` — :class:`ObjectStoreSync`, one Ray object-store put per bucket (``max_inflight``);
- ``broadcast`` — :class:`BroadcastSync`, torch.distributed gloo / NCCL (``backend``, ``master_addr``);
- ``disk`` — :class:`DiskSync`, safetensors shards per version (``directory``, ``keep``);
- ``shared_memory`` — :class:`SharedMemorySync`, one reused ``/dev/shm`` segment mapped by the
  trainer and every colocated engine, one call per engine per sync (``directory``).

The controller calls what ``relax.core.protocols.WeightSync`` lists (``sync``, ``check_engine``,
``close``); the run's fleet drives it (``controller.fleet``: ``sync(version)`` / ``publish(version)``).
A third-party transport that moves bytes between processes subclasses :class:`Transport` (``name``,
``config``, ``send``, a :class:`Receiver` subclass) -- these base classes are the contract for that
side -- and registers it in ``relax_register_weight_syncs`` as
``register(name, TransportClass, config=ParamsDataclass)``. Every call has a deadline; a dead or
stuck engine raises :class:`WeightSyncError` naming it, and after the update every engine must
report the new ``weight_version()``.
"""

from relax.core.weight_sync.base import WeightSyncError
from relax.core.weight_sync.broadcast import BroadcastParams, BroadcastReceiver, BroadcastSync
from relax.core.weight_sync.direct import InProcessParams, InProcessSync, ObjectStoreParams, ObjectStoreSync
from relax.core.weight_sync.disk import DiskParams, DiskReceiver, DiskSync
from relax.core.weight_sync.shared_memory import SharedMemoryParams, SharedMemoryReceiver, SharedMemorySync
from relax.core.weight_sync.transport import (
    Peers,
    Receiver,
    Transport,
    TransportSpec,
    serve_receiver,
    serve_sender,
)

TRANSPORTS: dict[str, type[Transport]] = {
    cls.name: cls for cls in (InProcessSync, ObjectStoreSync, BroadcastSync, DiskSync, SharedMemorySync)
}


def register_builtin_weight_syncs(register) -> None:
    """Called from ``relax.core.builtin``'s ``relax_register_weight_syncs`` hook."""
    for name, cls in TRANSPORTS.items():
        register(name, cls, config=cls.config)


__all__ = [
    "TRANSPORTS",
    "BroadcastParams",
    "BroadcastReceiver",
    "BroadcastSync",
    "DiskParams",
    "DiskReceiver",
    "DiskSync",
    "InProcessParams",
    "InProcessSync",
    "ObjectStoreParams",
    "ObjectStoreSync",
    "Peers",
    "Receiver",
    "SharedMemoryParams",
    "SharedMemoryReceiver",
    "SharedMemorySync",
    "Transport",
    "TransportSpec",
    "WeightSyncError",
    "register_builtin_weight_syncs",
    "serve_receiver",
    "serve_sender",
]
