"""Mamba shared-prefix (junction) checkpoint for EAGLE + Mamba ``align`` (vLLM PR #53945).

Under EAGLE the full-attention hit drops its last matched hash unit, so a sibling
that shares a prefix with an earlier request resumes *below* any Mamba state the
stock wheel cached and falls back to the previous block boundary. With the switch
on, the scheduler also ends a chunk exactly at the junction (the longest
single-group hit, ``request.shared_prefix_boundary``) and, under EAGLE, at the
prompt tail one hash unit down; the Mamba manager keeps the state found there.

Pieces (the backport for vLLM 0.26-0.29; 0.30+ has it natively):

* :mod:`.gate` - the single predicate both sides read (:class:`JunctionPlan`);
* :mod:`.split` - the stops added to the wheel's own split;
* :mod:`.manager` - the ``MambaManager`` subclass that checkpoints there;
* :mod:`.coordinator` - the ``HybridKVCacheCoordinator`` subclass that owns the plan
  and hands EAGLE-aware replay boundaries to its managers;
* :mod:`.fingerprints` - the shape checks that keep a changed wheel unpatched.
"""

from hybrid_kv_plugin.junction.coordinator import JunctionCoordinatorMixin, plan_of
from hybrid_kv_plugin.junction.gate import JunctionPlan, junction_plan, lowered_tail, replay_boundaries
from hybrid_kv_plugin.junction.split import exact_junction_stop, junction_stop

__all__ = [
    "JunctionCoordinatorMixin",
    "JunctionPlan",
    "exact_junction_stop",
    "junction_plan",
    "junction_stop",
    "lowered_tail",
    "plan_of",
    "replay_boundaries",
]
