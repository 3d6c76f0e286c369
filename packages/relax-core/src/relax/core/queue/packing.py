"""A batch on the wire to and from the queue actor: one pickle blob, cut into parts Ray inlines.

Ray serialises a list of 256 small arrays as 256 out-of-band buffers, and moves any argument or
return value over ``max_direct_call_object_size`` (100 KiB) through the object store -- together
~10 ms for 256 rows of 1 KB. One plain pickle blob, cut into parts under that limit and passed as
separate arguments (or return values), travels inline in the call itself: a few us per row.
ObjectRefs inside the batch (payloads offloaded to the object store) are pickled as indices and
passed beside the blob, so Ray still tracks them.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Sequence
from typing import Any

import ray

PART_BYTES = 90_000  # under Ray's 100 KiB inline limit for one argument / return value


class _RefPickler(pickle.Pickler):
    """Pickles ObjectRefs as indices into ``refs``."""

    def __init__(self, file: io.BytesIO, refs: list[Any]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.refs = refs

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, ray.ObjectRef):
            self.refs.append(obj)
            return len(self.refs) - 1
        return None


class _RefUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, refs: list[Any]):
        super().__init__(file)
        self.refs = refs

    def persistent_load(self, pid: int) -> Any:
        return self.refs[pid]


def encode(value: Any, may_hold_refs: bool = True) -> tuple[bytes, list[Any]]:
    """``value`` as one pickle blob and the ObjectRefs it holds (plain pickle; cloudpickle for what
    plain pickle refuses, e.g. a class defined in ``__main__`` of another process).
    ``may_hold_refs=False`` (the caller knows there are none) skips the per-object ref check."""
    refs: list[Any] = []
    try:
        if not may_hold_refs:
            return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), refs
        buf = io.BytesIO()
        _RefPickler(buf, refs).dump(value)
        return buf.getvalue(), refs
    except (pickle.PicklingError, AttributeError, TypeError):
        refs, buf = [], io.BytesIO()
        pickler = ray.cloudpickle.CloudPickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.refs = refs
        pickler.persistent_id = _RefPickler.persistent_id.__get__(pickler)
        pickler.dump(value)
        return buf.getvalue(), refs


def decode(parts: Sequence[bytes], refs: list[Any]) -> Any:
    blob = parts[0] if len(parts) == 1 else b"".join(parts)
    return _RefUnpickler(io.BytesIO(blob), refs).load()


def parts_for(nbytes: float) -> int:
    """How many parts keep each under :data:`PART_BYTES`."""
    return max(1, math.ceil(nbytes / PART_BYTES))


def split(blob: bytes, n_parts: int) -> list[bytes]:
    """``blob`` in exactly ``n_parts`` near-equal parts (the caller fixed the count in advance)."""
    size = math.ceil(len(blob) / n_parts) or 1
    return [blob[i * size : (i + 1) * size] for i in range(n_parts)]
