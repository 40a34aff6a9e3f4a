"""What each class of CPU-tier evictions cost later lookups: the evidence for the hybrid order's bet.

The hybrid order (offload/eviction.py) evicts demoted Mamba states (chunk ends a deeper state of
the same request superseded) before any LRU block. That pays where later requests continue from
where earlier ones ended (chats) and loses where they branch off at those chunk ends (prefix
trees). :class:`EvictionGhosts` remembers the keys the tier evicted, each with its class (demoted
or plain LRU); the order then asks, for a request's CPU-tier lookup, how many more tokens the
same lookup would have hit had one class's evicted keys still been held (a what-if lookup, run
by the wheel's own coordinator), and charges those tokens to that class. The order demotes while
a demoted eviction costs no more tokens than a plain one, per evicted block, over a recent window.

Counting tokens, not misses: an attention prefix is lost at its first missing block (the lookup
never asks for the rest), while a missing state only moves the resume point to the next state
below; a count of missed keys makes every demoted state look dearer than it is.

Invariants:

- at most ``capacity`` keys are remembered (the oldest goes first); a key evicted again
  replaces its old entry; a key the tier holds again is not a ghost (the lookup finds it);
  none survives a reset of the tier's cache (:meth:`EvictionGhosts.forget_keys`);
- the counts decay: once a window of evictions (``capacity``) has been recorded, every count is
  halved, so the verdict follows the workload as it changes;
- an eviction belongs to whoever chose it: *demoted* only for the order's own victims; a
  demoted copy that LRU evicts while the bet is withheld is *plain* (counted as demoted, such
  late evictions look cheap and turned the verdict back, 0.33 synthetic trace 0.637 -> 0.622);
- before ``min_demoted_evictions`` demoted evictions in all the verdict is to demote (the
  order as it was built); a count that decays would bring that back whenever demotion is
  withheld (no demoted victims then). While it is withheld, demoted evictions and their cost
  decay alike, so the verdict turns back only when plain evictions grow dearer.
"""

from __future__ import annotations

from typing import Any

PLAIN = 0
DEMOTED = 1
# Demoted evictions to see before the verdict can turn against demotion: 64, or an eighth of a
# smaller tier (at least 8).
MIN_DEMOTED_EVICTIONS = 64


class EvictionGhosts:
    """Recently evicted CPU-tier keys by class, and the tokens lookups lost to each class."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.min_demoted_evictions = min(MIN_DEMOTED_EVICTIONS, max(8, capacity // 8))
        self._classes: dict[Any, int] = {}  # key -> PLAIN or DEMOTED, oldest first
        self.evicted = [0.0, 0.0]
        self.lost = [0.0, 0.0]
        self._since_decay = 0
        self.totals = {"evicted_plain": 0, "evicted_demoted": 0, "lost_plain": 0, "lost_demoted": 0}

    def __len__(self) -> int:
        return len(self._classes)

    def kind(self, key: Any) -> int | None:
        """PLAIN or DEMOTED for a remembered key, None for any other."""
        return self._classes.get(key)

    def evicted_key(self, key: Any, demoted: bool) -> None:
        """The tier evicted the copy held under ``key``."""
        kind = DEMOTED if demoted else PLAIN
        classes = self._classes
        classes.pop(key, None)
        classes[key] = kind
        if len(classes) > self.capacity:
            del classes[next(iter(classes))]
        self.evicted[kind] += 1
        self.totals["evicted_demoted" if demoted else "evicted_plain"] += 1
        self._since_decay += 1
        if self._since_decay >= self.capacity:
            self._since_decay = 0
            self.evicted = [n / 2 for n in self.evicted]
            self.lost = [n / 2 for n in self.lost]

    def forget_keys(self) -> None:
        """The tier's cache was reset: no remembered key can be lost to an eviction any more (the
        reset would have removed it too). The counts, the evidence so far, stay."""
        self._classes.clear()

    def charge(self, kind: int, tokens: int) -> None:
        """A lookup would have hit ``tokens`` more had the evicted keys of ``kind`` been held."""
        if tokens > 0:
            self.lost[kind] += tokens
            self.totals["lost_demoted" if kind == DEMOTED else "lost_plain"] += tokens

    def demotion_pays(self) -> bool:
        """Whether a demoted eviction has cost no more tokens, per evicted block, than a plain one
        (True until ``min_demoted_evictions`` have been seen)."""
        if self.totals["evicted_demoted"] < self.min_demoted_evictions:
            return True
        plain, demoted = self.evicted
        return self.lost[DEMOTED] * max(plain, 1.0) <= self.lost[PLAIN] * demoted
