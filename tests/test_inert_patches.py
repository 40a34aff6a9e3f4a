"""Patches whose option is off for an engine are skipped on that engine's objects (scheduler CPU per step).

The machinery (``patching.bypass_inert_patches``) on a toy target, then what a real
scheduler of each wheel binds at the end of its constructor for each option.
"""

from __future__ import annotations

import functools
import inspect

import pytest

import hybrid_kv_plugin
from hybrid_kv_plugin import CONNECTOR_NAME
from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.connector_names import STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.patching import PATCH_MARKER, PatchSet, PatchSpec, bypass_inert_patches
from hybrid_kv_plugin.sim import HybridGeometry

from helpers import tokens

JUNCTION_BACKPORT_WHEELS = ("0.26.0", "0.27.1", "0.28.0", "0.29.0")
PROMPT_TAIL_WHEELS = ("0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")


class Toy:
    """Plays both the patched object and its scheduler: ``on`` names the patches whose option is on."""

    def __init__(self, *on: str) -> None:
        self.on = set(on)

    def step(self, x: int) -> tuple:
        return ("stock", x)


STOCK_STEP = Toy.step


def _toy_spec(name: str, *, with_inert_for: bool = True) -> PatchSpec:
    def build(original):
        @functools.wraps(original)
        def step(self, x):
            return (name, original(self, x)) if name in self.on else original(self, x)

        return step

    return PatchSpec(
        name=name,
        target=f"{__name__}:Toy.step",
        build=build,
        inert_for=(lambda obj, scheduler: name not in scheduler.on) if with_inert_for else None,
    )


@pytest.fixture
def toy_patches():
    patches = PatchSet([_toy_spec("inner"), _toy_spec("outer")])
    patches.install()
    yield patches
    patches.uninstall()
    assert Toy.step is STOCK_STEP


def test_all_inert_binds_the_stock_method(toy_patches):
    toy = Toy()
    assert bypass_inert_patches(toy, "step", toy) is True
    assert toy.__dict__["step"].__func__ is STOCK_STEP
    assert toy.step(7) == ("stock", 7)
    # The class keeps both patches for every other object.
    assert Toy("inner", "outer").step(7) == ("outer", ("inner", ("stock", 7)))


def test_peeling_stops_at_the_first_patch_that_is_on(toy_patches):
    toy = Toy("inner")
    assert bypass_inert_patches(toy, "step", toy) is True
    assert getattr(toy.__dict__["step"].__func__, PATCH_MARKER) == "inner"
    assert toy.step(7) == ("inner", ("stock", 7))

    outer_on = Toy("outer")
    assert bypass_inert_patches(outer_on, "step", outer_on) is False
    assert "step" not in outer_on.__dict__
    assert outer_on.step(7) == ("outer", ("stock", 7))


def test_a_patch_without_inert_for_is_never_peeled():
    # functools.wraps copies the inner patch's attributes onto the outer one; the outer's own
    # (absent) inert_for must win, or the inner's predicate would peel a patch it does not describe.
    patches = PatchSet([_toy_spec("inner"), _toy_spec("outer", with_inert_for=False)])
    patches.install()
    try:
        toy = Toy()
        assert bypass_inert_patches(toy, "step", toy) is False
        assert "step" not in toy.__dict__
    finally:
        patches.uninstall()
    assert Toy.step is STOCK_STEP


# ---------------------------------------------------------------------------------------------
# A real scheduler: what is bound at the end of its constructor


def _geometry() -> HybridGeometry:
    # EAGLE (the junction switch needs it) and a unit finer than the Mamba block (partial hits).
    return HybridGeometry(attention_block_size=16, mamba_block_size=16, hash_block_size=4, eagle=True)


def _bound(engine) -> dict[str, str]:
    """Per object, what the bypass bound on it: "stock" (the wheel's own function), or the patch
    the call now enters first."""
    scheduler = engine.scheduler
    coordinator = scheduler.kv_cache_manager.coordinator
    named = {"scheduler": (scheduler, "_mamba_block_aligned_split"), "coordinator": (coordinator, "cache_blocks")}
    for manager in coordinator.single_type_managers:
        for attr in ("cache_blocks", "_cache_partial_tail_block", "get_num_blocks_to_allocate"):
            named[f"{type(manager).__name__}.{attr}"] = (manager, attr)
    bound: dict[str, str] = {}
    for label, (obj, attr) in named.items():
        method = obj.__dict__.get(attr)
        if method is None:
            continue
        # The junction coordinator's and junction managers' stock class.
        owner = getattr(type(obj), "_stock_coordinator_cls", None) or getattr(type(obj), "hybrid_kv_stock_class", type(obj))
        stock = inspect.unwrap(getattr(owner, attr))
        func = method.__func__
        # A junction manager's own override, bound to fall through past inert patches.
        prefix, func = ("junction, then ", func.falls_through_to) if hasattr(func, "falls_through_to") else ("", func)
        bound[label] = prefix + ("stock" if func is stock else getattr(func, PATCH_MARKER, "other"))
    return bound


def mamba_manager_unpatched(adapter, under_async: bool = False) -> dict[str, str]:
    """The Mamba manager's bindings with every option off: the wheel's own methods, except the
    partial-tail one under AsyncScheduler where the vLLM fix ``prompt_tail_keyed_once`` (no
    option; inert without a sampled token in flight) goes in."""
    keyed_once = under_async and adapter.native_prompt_tail_keyed_after_its_chunk
    tail = "prompt_tail_keyed_once" if keyed_once else "stock"
    return {
        "MambaManager.cache_blocks": "stock",
        "MambaManager._cache_partial_tail_block": tail,
        **past_the_count_fix(adapter, under_async),
    }


def past_the_count_fix(adapter, under_async: bool = False, manager: str = "MambaManager") -> dict[str, str]:
    """The binding of a Mamba manager that gets bindings (0.30; the junction's) past the vLLM fix
    ``mamba_chunk_count_capped`` (0.26-0.30), inert under Scheduler; none under AsyncScheduler."""
    if adapter.mamba_chunk_count_capped or under_async:
        return {}
    return {f"{manager}.get_num_blocks_to_allocate": "stock"}


@pytest.mark.both_schedulers
@pytest.mark.parametrize("liveness", [True, False], ids=["liveness-on", "liveness-off"])
def test_liveness_switch_is_read_at_start_up(plugin, make_engine, adapter, liveness):
    """``async_load_liveness`` off binds the scheduler's step past its patch at start-up; on, the
    patch runs every step (and no longer reads the switch there). The outermost patch of the step,
    ``remaining_blocks_once_per_step``, is skipped too: without a connector nothing sums remaining blocks."""
    engine = make_engine(_geometry(), additional_config={"hybrid_kv": {"async_load_liveness": liveness}})
    scheduler = engine.scheduler
    assert getattr(type(scheduler).schedule, PATCH_MARKER) == "remaining_blocks_once_per_step.reset"
    bound = scheduler.__dict__["schedule"].__func__
    if adapter.first_waiting_queue_attr is None or not liveness:
        # 0.26-0.28 reserve no async loads (no liveness patch), or its switch is off: the wheel's own step.
        assert bound is inspect.unwrap(type(scheduler).schedule)
    else:
        assert getattr(bound, PATCH_MARKER) == "async_load_liveness"


@pytest.mark.both_schedulers
def test_options_off_bind_the_wheels_own_methods(plugin, make_engine, adapter, scheduling):
    engine = make_engine(_geometry())
    expected: dict[str, str] = {}
    if adapter.version in JUNCTION_BACKPORT_WHEELS:
        # Junction split off; the closed plan binds the stock coordinator method and leaves
        # the Mamba managers the wheel's own class.
        expected.update(scheduler="stock", coordinator="stock")
    if adapter.version in PROMPT_TAIL_WHEELS:
        expected.update(scheduler="stock")
    if adapter.mamba_split_aligns_below_cache_limit_only:
        # 0.26 under EAGLE (this geometry): the vLLM fix's block-end stop is not an option.
        expected.update(scheduler="mamba_split_keeps_block_grid")
    if adapter.mamba_manager_attributes_past_inline:
        # 0.30+: the Mamba manager is already off inline storage, so it is bound too.
        expected.update(mamba_manager_unpatched(adapter, under_async=scheduling == "async"))
    # Nothing else is bound on the managers (see hybrid_kv_plugin.inert_patches).
    assert _bound(engine) == expected
    managers = sorted(type(m).__name__ for m in engine.scheduler.kv_cache_manager.coordinator.single_type_managers)
    assert managers == ["FullAttentionManager", "MambaManager"]


def test_prompt_tail_on_keeps_its_patches(plugin, make_engine, adapter):
    config = {"hybrid_kv": {"prompt_tail_checkpoint": "both"}}
    if adapter.version not in PROMPT_TAIL_WHEELS:
        # Refused at start-up, before anything could be bound (the message: test_prompt_tail_checkpoint).
        with pytest.raises(PluginConfigError, match=r"prompt_tail_checkpoint: 'both' needs vLLM >= 0\.29\.0"):
            make_engine(_geometry(), additional_config=config)
        return
    engine = make_engine(_geometry(), additional_config=config)
    bound = _bound(engine)
    # The split (outermost: prompt_tail_split) keeps the class's patched path. 0.29 binds
    # nothing on the managers (their patches ask the manager's binding on each call); 0.30+
    # binds the Mamba manager's partial-tail method past the inert output-checkpoint patch,
    # onto the prompt-tail one, and leaves cache_blocks to the prompt-tail retention patch.
    expected: dict[str, str] = {}
    if adapter.version in JUNCTION_BACKPORT_WHEELS:
        expected["coordinator"] = "stock"
    if adapter.mamba_manager_attributes_past_inline:
        expected["MambaManager._cache_partial_tail_block"] = "prompt_tail_manager"
        expected.update(past_the_count_fix(adapter))
    assert bound == expected


def test_output_checkpoint_on_keeps_its_patches(plugin, make_engine, adapter):
    config = {"hybrid_kv": {"mamba_output_checkpoint": True}}
    if adapter.version not in PROMPT_TAIL_WHEELS:
        # Refused at start-up, before anything could be bound (the message: test_output_checkpoint).
        with pytest.raises(PluginConfigError, match=r"mamba_output_checkpoint: true needs vLLM >= 0\.29\.0"):
            make_engine(_geometry(), additional_config=config)
        return
    engine = make_engine(_geometry(), additional_config=config)
    expected: dict[str, str] = {"scheduler": "stock"}
    if adapter.version in JUNCTION_BACKPORT_WHEELS:
        expected["coordinator"] = "stock"
    if adapter.mamba_manager_attributes_past_inline:
        expected.update(past_the_count_fix(adapter))
    assert _bound(engine) == expected


@pytest.mark.both_schedulers
def test_junction_switch_on_keeps_the_junction_path(plugin, make_engine, adapter, scheduling):
    engine = make_engine(_geometry(), additional_config={"hybrid_kv": {"mamba_shared_prefix_checkpoint": True}})
    managers = sorted(type(m).__name__ for m in engine.scheduler.kv_cache_manager.coordinator.single_type_managers)
    bound = _bound(engine)
    if adapter.version in JUNCTION_BACKPORT_WHEELS:
        assert managers == ["FullAttentionManager", "JunctionMambaManager"]
        coordinator = engine.scheduler.kv_cache_manager.coordinator
        assert coordinator.retention_interval is None  # this engine: no sparse retention
        # No replay boundaries to hand over without sparse retention: coordinator and junction
        # managers run the stock cache_blocks. 0.29: the inert prompt-tail split is peeled down
        # to the junction split.
        # The junction binds its managers' cache_blocks itself (to the stock Mamba manager's: below).
        assert "JunctionMambaManager.cache_blocks" in bound
        del bound["JunctionMambaManager.cache_blocks"]
        expected: dict[str, str] = {"coordinator": "stock"}
        if adapter.version in PROMPT_TAIL_WHEELS:
            expected["scheduler"] = "junction_split"
        # The junction managers' partial-tail override falls through past the patches inert for
        # them: every one under Scheduler; under AsyncScheduler it stops at the vLLM fix
        # prompt_tail_keyed_once (0.26-0.28: the only patch there, so nothing is bound).
        if scheduling == "sync":
            expected["JunctionMambaManager._cache_partial_tail_block"] = "junction, then stock"
            expected.update(past_the_count_fix(adapter, manager="JunctionMambaManager"))
        elif adapter.version in PROMPT_TAIL_WHEELS:
            expected["JunctionMambaManager._cache_partial_tail_block"] = "junction, then prompt_tail_keyed_once"
        assert bound == expected
        for manager in coordinator.single_type_managers:
            if type(manager).__name__ == "JunctionMambaManager":
                assert manager.cache_blocks.__func__ is coordinator._stock_mamba_manager_cls.cache_blocks
    else:  # native junction: nothing of the plugin's junction is installed
        assert managers == ["FullAttentionManager", "MambaManager"]
        assert bound == {"scheduler": "stock", **mamba_manager_unpatched(adapter, under_async=scheduling == "async")}


# ---------------------------------------------------------------------------------------------
# Attribute storage: the plugin leaves vLLM's per-step objects on the interpreter's fast path


def _attributes_inline(obj) -> bool:
    """Whether CPython still keeps ``obj``'s attributes in their inline storage.

    Once an object's ``__dict__`` is read or written directly, or its ``__class__``
    reassigned, CPython 3.11 moves its attributes to a dictionary for good and every
    attribute read and method call on it takes the slow path (2.4x per access).
    """
    import ctypes
    import sys

    assert type(obj).__flags__ & (1 << 4), f"{type(obj).__name__} has no managed dict"  # Py_TPFLAGS_MANAGED_DICT
    word = ctypes.sizeof(ctypes.c_void_p)
    if sys.version_info[:2] == (3, 11):  # values pointer, then dict pointer, before the object
        values = ctypes.c_void_p.from_address(id(obj) - 4 * word).value
        materialized = ctypes.c_void_p.from_address(id(obj) - 3 * word).value
        return bool(values) and not materialized
    if sys.version_info[:2] == (3, 12):  # one tagged word: low bit set = inline values
        return bool((ctypes.c_void_p.from_address(id(obj) - 3 * word).value or 0) & 1)
    raise AssertionError(f"no attribute-storage probe for CPython {sys.version_info[:2]}: add one")


def _per_step_objects(engine) -> dict[str, object]:
    scheduler = engine.scheduler
    coordinator = scheduler.kv_cache_manager.coordinator
    objects = {"kv_cache_manager": scheduler.kv_cache_manager, "coordinator": coordinator, "block_pool": coordinator.block_pool}
    for manager in coordinator.single_type_managers:
        objects[f"gpu {type(manager).__name__}"] = manager
    offload = scheduler.connector.scheduler_manager
    objects.update(connector=scheduler.connector, offload_scheduler=offload, cpu_coordinator=offload.cpu_coordinator)
    for manager in offload.cpu_coordinator.single_type_managers:
        objects[f"cpu {type(manager).__name__}"] = manager
    return objects


def _inline_after_a_replay(adapter, connector: str) -> dict[str, bool]:
    from hybrid_kv_plugin.sim import SimEngine

    engine = SimEngine(
        HybridGeometry(), adapter=adapter, kv_connector=connector, kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24}
    )
    prompt = tokens(200)
    engine.run([("first", prompt)], max_tokens=4)
    assert engine.reset_prefix_cache()
    engine.run([("again", [*prompt, 7, 8, 9])], max_tokens=4)
    return {label: _attributes_inline(obj) for label, obj in _per_step_objects(engine).items()}


def stock_then_plugin() -> dict[str, dict[str, bool]]:
    """In a fresh interpreter: a stock engine (its classes' shared inline slots shrink with each
    instance, as a long-lived server's do), then an engine with the plugin and its connector."""
    from hybrid_kv_plugin.adapters import select_adapter

    adapter = select_adapter().adapter
    hybrid_kv_plugin.uninstall()
    stock = _inline_after_a_replay(adapter, STOCK_CONNECTOR_NAME)
    hybrid_kv_plugin.register()
    try:
        plugin = _inline_after_a_replay(adapter, CONNECTOR_NAME)
    finally:
        hybrid_kv_plugin.uninstall()
    return {"stock": stock, "plugin": plugin}


def test_plugin_keeps_attributes_inline_where_stock_does(adapter):
    """With the plugin's connector and every plugin patch in, each object vLLM touches per step
    keeps its attributes inline exactly where stock vLLM with its own connector does.

    A fresh interpreter: how many instances of a class the earlier tests created decides how
    many attributes a new one can still add inline, for stock and plugin alike.
    """
    import json
    import os
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_inert_patches as t; "
        "print('INLINE=' + json.dumps(t.stock_then_plugin()))"
    )
    done = subprocess.run([sys.executable, "-c", script, tests_dir], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("INLINE="))[len("INLINE="):])
    stock, plugin = found["stock"], found["plugin"]
    assert plugin == stock
    # Where the adapter says the Mamba manager is past inline storage, managers get bindings.
    assert stock["gpu MambaManager"] is not adapter.mamba_manager_attributes_past_inline
    # The objects this checks are mostly inline on stock vLLM (the bigger Mamba managers and the
    # offload scheduler of 0.30+ hold more than 30 attributes and are not): the check can fail.
    assert sum(stock.values()) >= 7, stock


# The full-block marks of local_hit_admission, on the engine's GPU pool: only where a hit can end inside
# a full attention block, on blocks coarser than the unit of 16 (an EAGLE-family drafter drops one unit;
# the hybrid model's Mamba state at a unit boundary cuts the hit, EAGLE or not).
@pytest.mark.parametrize(
    ("attention_block", "eagle", "enters"),
    [(16, True, "stock"), (32, False, "local_hit_admission.mark_full"), (32, True, "local_hit_admission.mark_full")],
)
def test_full_block_marks_only_where_a_hit_can_end_inside_one(plugin, make_engine, attention_block, eagle, enters):
    from vllm.v1.core.block_pool import BlockPool

    geometry = HybridGeometry(attention_block_size=attention_block, mamba_block_size=64, hash_block_size=16, eagle=eagle)
    pool = make_engine(geometry).scheduler.kv_cache_manager.block_pool
    func = pool.cache_full_blocks.__func__  # an attribute read: the pool's storage stays as it is
    assert ("stock" if func is inspect.unwrap(BlockPool.cache_full_blocks) else getattr(func, PATCH_MARKER, "other")) == enters
