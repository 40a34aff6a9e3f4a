"""A request's remaining blocks are counted once per scheduling step (patch ``remaining_blocks_once_per_step``).

The admission sums (vLLM's async-load reservation; under ``AsyncScheduler`` also the
plugin's running-prefill reservation) ask ``_request_remaining_blocks`` for every
in-flight prefill at every admission. The patch answers repeats from a record kept for
one step. A 300-request replay through the plugin's connector (the real scheduler of
each wheel, async CPU loads, both schedulers) asks the wheel's own method as well at
every call: the answers must be equal, and the figures say how many counts the record
saved.
"""

from __future__ import annotations

import inspect

import pytest

from hybrid_kv_plugin.patching import PATCH_MARKER
from hybrid_kv_plugin.sim import HybridGeometry
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.sim.workload import workload_of_size

REQUESTS = 300
# Per wheel and scheduler: (counts asked, answered from the record) over the replay. Under
# AsyncScheduler the plugin's own reservation sums too; about nine in ten counts are repeats.
FIGURES = {
    "0.26.0": {"sync": (1683, 1482), "async": (4735, 4348)},
    "0.27.1": {"sync": (1683, 1482), "async": (4735, 4348)},
    "0.28.0": {"sync": (1640, 1478), "async": (4641, 4257)},
    "0.29.0": {"sync": (1659, 1474), "async": (4681, 4271)},
    "0.30.0": {"sync": (1664, 1478), "async": (4681, 4271)},
    "0.31.0": {"sync": (1664, 1478), "async": (4681, 4271)},
    "0.32.0": {"sync": (1674, 1482), "async": (4768, 4350)},
    "0.33.0": {"sync": (1674, 1482), "async": (4768, 4350)},
}


class CheckedCounts:
    """Installed on the replay's scheduler: each count also asks the wheel's own method, and a count
    that reaches the KV-cache coordinator is one the record did not answer."""

    def __init__(self) -> None:
        self.calls = self.from_record = self.mismatches = 0

    def install(self, scheduler) -> None:
        recorded = type(scheduler)._request_remaining_blocks
        wheel = inspect.unwrap(recorded)
        assert wheel is not recorded  # the patch is in place
        coordinator = scheduler.kv_cache_manager.coordinator
        coordinator_count = coordinator.get_num_blocks_to_allocate
        asked = [0]

        def counted_by_the_coordinator(*args, **kwargs):
            asked[0] += 1
            return coordinator_count(*args, **kwargs)

        def checked(request):
            asked[0] = 0
            answer = recorded(scheduler, request)
            self.calls += 1
            self.from_record += asked[0] == 0
            self.mismatches += answer != wheel(scheduler, request)
            return answer

        coordinator.get_num_blocks_to_allocate = counted_by_the_coordinator
        scheduler._request_remaining_blocks = checked


@pytest.mark.parametrize("scheduling", ["sync", "async"], indirect=True)
def test_recorded_counts_equal_the_wheels(plugin, adapter, wheel_version, scheduling):
    config = CONFIGS["plugin+divergence" if adapter.divergence_checkpoint_supported else "plugin"]
    checked = CheckedCounts()
    result = replay(
        tuple(workload_of_size(REQUESTS, 0)), ReplaySettings(), config, observe=False, per_request=False, timer=checked
    )
    assert result.refused is None
    assert checked.mismatches == 0
    assert (checked.calls, checked.from_record) == FIGURES[wheel_version][scheduling]


def test_bound_past_where_no_admission_sums(plugin, make_engine, scheduling):
    # No connector and Scheduler: nothing sums remaining blocks, so the scheduler skips both wrappers
    # (the count is the wheel's own; the step enters the next patch of schedule, or the wheel's).
    scheduler = make_engine(HybridGeometry()).scheduler
    count = scheduler.__dict__["_request_remaining_blocks"].__func__
    assert count is inspect.unwrap(type(scheduler)._request_remaining_blocks)
    step = scheduler.__dict__["schedule"].__func__
    assert getattr(step, PATCH_MARKER, None) != "remaining_blocks_once_per_step.reset"
    assert getattr(type(scheduler).schedule, PATCH_MARKER) == "remaining_blocks_once_per_step.reset"
