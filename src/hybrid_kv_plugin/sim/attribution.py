"""Why a replayed request reused less than its ideal: one bucket per lost token.

The facts come from what the replay observes, never from a model of the wheel:

* the **ideal** ``I`` of a request (:func:`hybrid_kv_plugin.sim.workload.ideal_reuse`) and
  what it actually **reused** ``R`` (its first-scheduled ``num_computed_tokens``);
* the **Mamba grid**: every prefix position at which a Mamba state existed before the
  request arrived. A hybrid hit can only end where the recurrent state of the whole
  prefix exists, so this is the real ceiling. Observed from the boundary hand-offs the
  wheel publishes (``kv_connector_block_state.boundary_state_offloads``, one entry per
  retained state), from the positions other requests were served at, and, on wheels that
  publish no hand-offs (they retain every whole Mamba block), from whole Mamba blocks;
* the **tiers at admission**: the GPU hit handed to the connector (``local``) and what the
  CPU tier held contiguously beyond it (a read-only lookup on the connector's own CPU
  coordinator, made at the moment the connector is asked). ``served`` is ``local`` plus that
  suffix when there is one, else the GPU hit the scheduler settled on;
* the **fate of each grid state's offload**: the connector's boundary-store counters in the
  step that published it (``get_boundary_store_stats()``, read only where the connector has
  it), whether its request was already gone, and whether the CPU pool ever evicted.

Split of the loss ``I - R``, walking down from the ideal (each token lands once):

0. ``eagle_prune``: under EAGLE, the top ``eagle_drop`` tokens (one full-attention block).
   The request shares exactly ``I`` tokens and the EAGLE lookup must match one block more
   than it keeps, so no cache state can serve that block. The walk continues from
   ``ceiling = I - eagle_prune``.
1. ``no_mamba_state``: ``(top, ceiling]`` where ``top`` is the best position at or below
   the ceiling on the grid (or served by a tier). Nothing the cache could have done: no
   request ever had the recurrent state there.
2. ``(served, top]``, where ``served`` is the best a tier could still serve at admission:
   the state existed but was no longer usable. By the state's fate: declined for lack of
   CPU blocks -> ``cpu_pool_full``; declined, or never offered to the CPU tier while the
   CPU pool never evicted anything -> ``handoff_dropped``; stored (or possibly stored) but
   gone by then -> ``evicted``.
3. ``(R, served]``: a tier held it and the request still did not get it. The connector
   skips its lookup when the local hit is not on the scheduler-block grid ->
   ``misaligned_local_prefix``; anything else -> ``unexplained`` (kept visible, expected 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Bucket(str, Enum):
    NO_MAMBA_STATE = "no_mamba_state"
    MISALIGNED_LOCAL_PREFIX = "misaligned_local_prefix"
    EAGLE_PRUNE = "eagle_prune"
    CPU_POOL_FULL = "cpu_pool_full"
    HANDOFF_DROPPED = "handoff_dropped"
    EVICTED = "evicted"
    UNEXPLAINED = "unexplained"

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {
    Bucket.NO_MAMBA_STATE: "no Mamba state on the grid",
    Bucket.MISALIGNED_LOCAL_PREFIX: "misaligned local prefix",
    Bucket.EAGLE_PRUNE: "EAGLE prune",
    Bucket.CPU_POOL_FULL: "CPU pool full",
    Bucket.HANDOFF_DROPPED: "boundary handoff dropped",
    Bucket.EVICTED: "evicted",
    Bucket.UNEXPLAINED: "unexplained",
}


class Fate(str, Enum):
    """What happened when a grid state was (or was not) offered to the CPU tier."""

    KEPT = "kept"  # stored, or already / about to be on the CPU (connector counted it)
    CPU_FULL = "cpu_full"  # declined: no free CPU block
    DROPPED = "dropped"  # declined: request gone, null block, not hashed, a request end kept off the tier
    UNKNOWN = "unknown"  # no counters (connector ignores hand-offs, or no hand-off channel)


@dataclass(frozen=True)
class Admission:
    """Facts about one request at its first scheduling (all token counts)."""

    ideal: int
    reused: int
    grid: int  # best grid position <= ideal (0: none)
    grid_fate: Fate
    served: int  # best a tier could serve: local + CPU beyond local
    misaligned: bool  # the local hit was off the scheduler-block grid
    eagle_drop: int  # tokens the EAGLE lookup drops at the end of a hit (0 without EAGLE)
    cpu_evicted_before: bool  # the CPU pool had evicted at least one block by then


def split_loss(facts: Admission) -> dict[Bucket, int]:
    """Buckets of ``max(ideal - reused, 0)``; they always sum to it."""
    ideal, reused = facts.ideal, min(facts.reused, facts.ideal)
    if reused >= ideal:
        return {}
    out: dict[Bucket, int] = {}

    def add(bucket: Bucket, tokens: int) -> None:
        if tokens > 0:
            out[bucket] = out.get(bucket, 0) + tokens

    # A request shares exactly ``ideal`` tokens, and under EAGLE the lookup matches one
    # more drop unit than it keeps, so the last unit below the ideal is out of reach.
    pruned = min(facts.eagle_drop, ideal - reused)
    add(Bucket.EAGLE_PRUNE, pruned)
    ceiling = ideal - pruned
    top = min(max(facts.grid, facts.served, reused), ceiling)
    served = min(max(facts.served, reused), top)
    add(Bucket.NO_MAMBA_STATE, ceiling - top)
    add(fate_bucket(facts.grid_fate, facts.cpu_evicted_before), top - served)
    add(Bucket.MISALIGNED_LOCAL_PREFIX if facts.misaligned else Bucket.UNEXPLAINED, served - reused)
    return out


def fate_bucket(fate: Fate, cpu_evicted_before: bool) -> Bucket:
    """Why a state that existed could not be served any more."""
    if fate is Fate.CPU_FULL:
        return Bucket.CPU_POOL_FULL
    if fate is Fate.DROPPED:
        return Bucket.HANDOFF_DROPPED
    if fate is Fate.UNKNOWN and not cpu_evicted_before:
        # Nothing ever left the CPU pool, so the state never reached it.
        return Bucket.HANDOFF_DROPPED
    return Bucket.EVICTED


def fate_of_step(outcomes: dict[str, int] | None) -> Fate:
    """One fate for the hand-offs a step published, from the growth of the connector's counters
    in that step (``None``: the connector has no counters). Any lack of CPU blocks wins: the
    step ran out of room; otherwise a step that stored or skipped nothing declined them."""
    if outcomes is None:
        return Fate.UNKNOWN
    if outcomes.get("dropped_cpu_full", 0):
        return Fate.CPU_FULL
    kept = sum(outcomes.get(k, 0) for k in ("stored", "skipped_already_cached", "skipped_in_flight"))
    declined = sum(
        outcomes.get(k, 0)
        for k in ("dropped_request_gone", "dropped_null_block", "dropped_not_hashed", "declined_request_end")
    )
    if declined and not kept:
        return Fate.DROPPED
    return Fate.KEPT


class MambaGrid:
    """Positions with a Mamba state, keyed by the prefix they summarise (see ``prefix_keys``).

    The first observation of a position decides its fate, except that a later KEPT
    (the state was offloaded after all) overrides a decline.
    """

    def __init__(self) -> None:
        self._fates: dict[int, Fate] = {}

    def __len__(self) -> int:
        return len(self._fates)

    def add(self, key: int, fate: Fate) -> None:
        previous = self._fates.get(key)
        if previous is None or (fate is Fate.KEPT and previous is not Fate.KEPT):
            self._fates[key] = fate

    def best(self, keys: list[int], limit_units: int) -> tuple[int, Fate]:
        """(units, fate) of the longest prefix of ``keys[:limit_units]`` on the grid; (0, UNKNOWN) if none."""
        for units in range(min(limit_units, len(keys)), 0, -1):
            fate = self._fates.get(keys[units - 1])
            if fate is not None:
                return units, fate
        return 0, Fate.UNKNOWN


def total(buckets_per_request: dict[str, dict[Bucket, int]]) -> dict[str, int]:
    """Sum per bucket, every bucket present (0 when empty), in the fixed bucket order."""
    sums = {b.value: 0 for b in Bucket}
    for buckets in buckets_per_request.values():
        for bucket, tokens in buckets.items():
            sums[bucket.value] += tokens
    return sums
