"""Patches whose option is off for an engine are skipped on that engine's objects (scheduler CPU per step).

The machinery (``patching.bypass_inert_patches``) on a toy target, then what a real
scheduler of each wheel binds at the end of its constructor for each option.
"""

from __future__ import annotations

import functools
import inspect

import pytest

from hybrid_kv_plugin.config import PluginConfigError
from hybrid_kv_plugin.patching import PATCH_MARKER, PatchSet, PatchSpec, bypass_inert_patches
from hybrid_kv_plugin.sim import HybridGeometry

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
        named[type(manager).__name__] = (manager, "_cache_partial_tail_block")
    bound: dict[str, str] = {}
    for label, (obj, attr) in named.items():
        method = obj.__dict__.get(attr)
        if method is None:
            continue
        owner = getattr(type(obj), "_stock_coordinator_cls", type(obj))  # the junction coordinator's stock
        stock = inspect.unwrap(getattr(owner, attr))
        bound[label] = "stock" if method.__func__ is stock else getattr(method.__func__, PATCH_MARKER, "other")
    return bound


def test_options_off_bind_the_wheels_own_methods(plugin, make_engine, adapter):
    engine = make_engine(_geometry())
    expected: dict[str, str] = {}
    if adapter.version in JUNCTION_BACKPORT_WHEELS:
        # Junction split off; the closed plan binds the stock coordinator method and leaves
        # the Mamba managers the wheel's own class.
        expected.update(scheduler="stock", coordinator="stock")
    if adapter.version in PROMPT_TAIL_WHEELS:
        expected.update(scheduler="stock", FullAttentionManager="stock", MambaManager="stock")
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
    # The split (outermost: prompt_tail_split) and both managers keep the class's patched path;
    # only the output checkpoint, off, is peeled from the Mamba manager.
    expected: dict[str, str] = {"MambaManager": "prompt_tail_manager"}
    if adapter.version in JUNCTION_BACKPORT_WHEELS:
        expected["coordinator"] = "stock"
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
    assert _bound(engine) == expected


def test_junction_switch_on_keeps_the_junction_path(plugin, make_engine, adapter):
    engine = make_engine(_geometry(), additional_config={"hybrid_kv": {"mamba_shared_prefix_checkpoint": True}})
    managers = sorted(type(m).__name__ for m in engine.scheduler.kv_cache_manager.coordinator.single_type_managers)
    bound = _bound(engine)
    if adapter.version in JUNCTION_BACKPORT_WHEELS:
        assert managers == ["FullAttentionManager", "JunctionMambaManager"]
        # 0.29: the inert prompt-tail split is peeled down to the junction split.
        expected: dict[str, str] = {}
        if adapter.version in PROMPT_TAIL_WHEELS:
            expected = {"scheduler": "junction_split", "FullAttentionManager": "stock"}
        assert bound == expected
    else:  # native junction: nothing of the plugin's junction is installed
        assert managers == ["FullAttentionManager", "MambaManager"]
        assert bound == {"scheduler": "stock", "FullAttentionManager": "stock", "MambaManager": "stock"}
