"""torch's default process group for a trainer's ranks (megatron-core and FSDP2 build on it)."""

from __future__ import annotations

import datetime
import functools
import tempfile
from collections.abc import Callable

import torch.distributed as dist


def join_default_group(
    rank: int,
    world_size: int,
    master_addr: str | None,
    master_port: int | None,
    backend: str,
    timeout_s: float,
) -> bool:
    """Join (or reuse) torch's default process group; every collective on it waits at most
    ``timeout_s``. The trainer's rank actors own their processes, so the default group is theirs;
    weight-sync transports build private groups beside it. A world of one needs no rendezvous (a
    file store); an existing group of another size is an error. True when this call created the
    group (its owner destroys it)."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised with world size {dist.get_world_size()}, "
                f"not the trainer's {world_size}"
            )
        return False
    if master_addr is None or master_port is None:
        if world_size != 1:
            raise ValueError(f"world_size={world_size} needs the worker group's master_addr and master_port")
        init = f"file://{tempfile.mkdtemp(prefix='relax-trainer-')}/store"
    else:
        init = f"tcp://{master_addr}:{master_port}"
    dist.init_process_group(
        backend,
        init_method=init,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return True


def releases_group_on_error(init: Callable) -> Callable:
    """A trainer's ``__init__`` that, when it raises after creating torch's default group (``self._owns_group``),
    destroys the group first: a failed construction leaves no group behind for the next trainer in the
    process to trip over ("initialize the default process group twice")."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            if getattr(self, "_owns_group", False) and dist.is_initialized():
                dist.destroy_process_group()
            raise

    return wrapper
