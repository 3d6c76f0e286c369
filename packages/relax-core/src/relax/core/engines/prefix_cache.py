"""Finished requests' KV caches, kept by token sequence so a later request that continues one
prefills only its new suffix (multi-turn rollouts: each turn's prompt is the previous turn's
prompt + response + observation, ``relax.core.agentic.Turns``).

Bounded by bytes and evicted least recently used first; an entry that served a hit goes to the
front of the eviction order, since the request it served will store its own longer sequence when it
finishes. KV computed with other weights is stale: entries carry the weight version they were
computed with, and the first use under another version drops them all (the engine also clears the
cache on every weight update).

Lookups find the longest cached sequence the prompt starts with. Entries are indexed by a chained
hash of their whole blocks of ``BLOCK`` tokens (as paged KV caches hash blocks), so a lookup hashes
the prompt once, block by block, and checks exactly (one tuple lookup per candidate length) only
entries whose every whole block equals the prompt's: entries that merely share a long system prompt
with it cost nothing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from relax.core.engines.kv_batch import Layers

BLOCK = 16  # tokens per hashed block of the index


def block_chain(tokens: Sequence[int], blocks: int) -> list[int]:
    """Chained hashes of the first ``blocks`` whole blocks: entry ``m`` covers ``tokens[: m * BLOCK]``."""
    chain = [0]
    for m in range(blocks):
        chain.append(hash((chain[-1], *tokens[m * BLOCK : (m + 1) * BLOCK])))
    return chain


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix of a prompt: its ``length`` tokens' per-layer KV (``(1, H, length, D)`` each)."""

    length: int
    layers: Layers


def layers_nbytes(layers: Layers) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


class PrefixCache:
    """LRU-by-bytes map from token sequences to their KV (``capacity_bytes`` 0: keeps nothing)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = max(0, int(capacity_bytes))
        self._entries: OrderedDict[tuple[int, ...], tuple[Layers, int, int]] = (
            OrderedDict()
        )  # oldest first; (kv, bytes, block hash)
        # chained hash of an entry's whole blocks -> how many entries with it have each length
        self._index: dict[int, Counter[int]] = {}
        self._version: int | None = None
        self.nbytes = 0
        self.lookups = self.hits = self.reused_tokens = self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.nbytes = 0

    def _at(self, version: int) -> None:
        """Entries of another weight version than ``version`` are stale: drop them all."""
        if version != self._version:
            self.clear()
            self._version = version

    def put(self, tokens: Sequence[int], layers: Layers, version: int) -> None:
        """Keep ``layers`` (owned by the cache from now on: pass copies, not views of a batch cache)
        as the KV of ``tokens``, computed with weights ``version``. Too big for the cache: not kept."""
        if not self.enabled or not tokens:
            return
        self._at(version)
        key = tuple(tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        size = layers_nbytes(layers)
        if size > self.capacity_bytes:
            return
        while self.nbytes + size > self.capacity_bytes:
            self._evict_oldest()
        block_hash = block_chain(key, len(key) // BLOCK)[-1]
        self._entries[key] = (layers, size, block_hash)
        self._index.setdefault(block_hash, Counter())[len(key)] += 1
        self.nbytes += size

    def _evict_oldest(self) -> None:
        key, (_, size, block_hash) = self._entries.popitem(last=False)
        lengths = self._index[block_hash]
        lengths[len(key)] -= 1
        if not lengths[len(key)]:
            del lengths[len(key)]
            if not lengths:
                del self._index[block_hash]
        self.nbytes -= size
        self.evictions += 1

    def longest_prefix(self, prompt: Sequence[int], version: int) -> PrefixHit | None:
        """The longest cached sequence ``prompt`` starts with, cut to leave at least one prompt token
        to prefill (whose logits sample the first new token); None on a miss."""
        if not self.enabled:
            return None
        self._at(version)
        self.lookups += 1
        if not self._entries:
            return None
        chain = block_chain(prompt, len(prompt) // BLOCK)
        for blocks in range(len(chain) - 1, -1, -1):  # longer entries first
            for length in sorted(self._index.get(chain[blocks], ()), reverse=True):
                if length > len(prompt) or length // BLOCK != blocks:
                    continue  # a hash collision across block counts, or longer than the prompt
                key = tuple(prompt[:length])
                if key in self._entries:
                    return self._hit(key, min(length, len(prompt) - 1))
        return None

    def _hit(self, key: tuple[int, ...], use: int) -> PrefixHit | None:
        """``key``'s KV cut to its first ``use`` positions (a prompt equal to ``key`` prefills its last token)."""
        self._entries.move_to_end(key, last=False)  # superseded once the continuation finishes
        if use <= 0:
            return None
        layers = self._entries[key][0]
        if use < len(key):
            layers = [(k[..., :use, :], v[..., :use, :]) for k, v in layers]
        self.hits += 1
        self.reused_tokens += use
        return PrefixHit(use, layers)

    def stats(self) -> dict[str, float]:
        """Flat numbers for ``health()``: size, hits and the hit rate over lookups so far."""
        return {
            "prefix_cache_entries": len(self._entries),
            "prefix_cache_bytes": self.nbytes,
            "prefix_cache_capacity_bytes": self.capacity_bytes,
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_rate": self.hits / self.lookups if self.lookups else 0.0,
            "prefix_cache_reused_tokens": self.reused_tokens,
            "prefix_cache_evictions": self.evictions,
        }
