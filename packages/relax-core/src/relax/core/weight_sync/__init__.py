"""Weight sync: move trainer weights to rollout engines under a version number.

Transports (all implement ``relax.core.protocols.WeightSync``; constructors are the factories,
``factory(timeout_s, bucket_bytes, **kw)``):

- ``"in_process"`` — :class:`InProcessSync`, direct calls (colocated trainer and engines);
- ``"object_store"`` — :class:`ObjectStoreSync`, one Ray object-store put per bucket;
- ``"broadcast"`` — :class:`BroadcastSync`, torch.distributed (gloo / NCCL); engines mix in
  :class:`BroadcastReceiver`;
- ``"disk"`` — :class:`DiskSync`, safetensors shards; engines mix in :class:`DiskReceiver`.

Every call has a deadline; a dead or stuck engine raises :class:`WeightSyncError` naming it, and
after the update every engine must report the new ``weight_version()``.
"""

from relax.core.weight_sync.base import WeightSyncError
from relax.core.weight_sync.broadcast import BroadcastReceiver, BroadcastSync
from relax.core.weight_sync.direct import InProcessSync, ObjectStoreSync
from relax.core.weight_sync.disk import DiskReceiver, DiskSync

TRANSPORTS = {
    "in_process": InProcessSync,
    "object_store": ObjectStoreSync,
    "broadcast": BroadcastSync,
    "disk": DiskSync,
}


def register_builtin_weight_syncs(register) -> None:
    """Called from ``relax.core.builtin``'s ``relax_register_weight_syncs`` hook."""
    for name, factory in TRANSPORTS.items():
        register(name, factory)


__all__ = [
    "TRANSPORTS",
    "BroadcastReceiver",
    "BroadcastSync",
    "DiskReceiver",
    "DiskSync",
    "InProcessSync",
    "ObjectStoreSync",
    "WeightSyncError",
    "register_builtin_weight_syncs",
]
