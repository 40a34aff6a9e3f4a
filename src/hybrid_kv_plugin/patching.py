"""All-or-nothing installation of the plugin's patches into vLLM.

A :class:`PatchSpec` names one attribute of vLLM (``module:Owner.attr``), the
shape the plugin expects it to have (:class:`Fingerprint`, or
:class:`ReadsFingerprint` when the stock code's own inputs matter), and how to
build its replacement from the original. :class:`PatchSet` resolves and checks
*every* target before it touches any: one mismatch and nothing is patched.
Originals are recorded so :meth:`PatchSet.uninstall` restores vLLM exactly
(including deleting an attribute that a subclass only inherited before).
:func:`bypass_inert_patches` lets one object skip the patches whose option is off for
it (``PatchSpec.inert_for``), so an engine pays nothing per step for them.
:class:`Installs` is what each patch module declares for the manifest
(:mod:`hybrid_kv_plugin.patches`): on which wheels the patch applies.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

from hybrid_kv_plugin.process_role import Side

PATCH_MARKER = "__hybrid_kv_patch__"
# On a replacement: its spec's ``inert_for`` (None: never bypassed).
INERT_MARKER = "__hybrid_kv_inert_for__"


class PatchMismatch(RuntimeError):
    """A patch target is missing or does not have the shape the plugin was written for."""

    def __init__(self, target: str, reason: str):
        super().__init__(f"{target}: {reason}")
        self.target = target
        self.reason = reason


@dataclass(frozen=True)
class Fingerprint:
    """What the original must look like for the patch to be safe.

    ``params``: the callable's parameter names, in order, as a prefix of its
    signature (extra trailing parameters of a newer wheel are a mismatch only
    when ``exact``). ``attrs``: attributes that must exist on the original
    (classes) or on its owner (methods).
    """

    params: tuple[str, ...] | None = None
    exact: bool = False
    attrs: tuple[str, ...] = ()
    owner_attrs: tuple[str, ...] = ()

    def check(self, original: Any, owner: Any) -> str | None:
        if self.params is not None:
            try:
                names = tuple(inspect.signature(original).parameters)
            except (TypeError, ValueError):
                return "is not a function with a readable signature"
            want = self.params
            if names[: len(want)] != want or (self.exact and names != want):
                return f"signature is ({', '.join(names)}), expected ({', '.join(want)}{'' if self.exact else ', ...'})"
        missing = [a for a in self.attrs if not hasattr(original, a)]
        missing += [a for a in self.owner_attrs if not hasattr(owner, a)]
        if missing:
            return f"missing attribute(s) {', '.join(missing)}"
        return None


def self_attribute_reads(function: Callable[..., Any]) -> frozenset[str]:
    """Every ``self.<name>`` the function's own body loads (not nested functions).

    A wrapper (``functools.wraps``) answers for the function it wraps, so the check
    still holds while the plugin's own wrapper is installed.
    """
    names = set()
    previous = None
    for instruction in dis.get_instructions(inspect.unwrap(function)):
        if (
            previous is not None
            # LOAD_DEREF: ``self`` is a cell when a nested function captures it.
            and (previous.opname.startswith("LOAD_FAST") or previous.opname == "LOAD_DEREF")
            and previous.argval == "self"
            and instruction.opname in ("LOAD_ATTR", "LOAD_METHOD")
        ):
            names.add(instruction.argval)
        previous = instruction
    return frozenset(names)


@dataclass(frozen=True)
class ReadsFingerprint(Fingerprint):
    """``Fingerprint`` plus the ``self`` attributes the original reads (exactly, or ``at_least``)."""

    self_reads: frozenset[str] = frozenset()
    # True: the original must read at least ``self_reads`` (other reads may come and go).
    at_least: bool = False

    def check(self, original: Any, owner: Any) -> str | None:
        if reason := super().check(original, owner):
            return reason
        found = self_attribute_reads(original)
        if self.at_least and self.self_reads <= found:
            return None
        if found != self.self_reads:
            extra = ", ".join(sorted(found - self.self_reads)) or "-"
            missing = ", ".join(sorted(self.self_reads - found)) or "-"
            return f"reads different scheduler attributes (new: {extra}; gone: {missing})"
        return None


@dataclass(frozen=True)
class Installs:
    """Which wheels get a patch: declared by each patch module as ``INSTALLS``.

    ``when`` decides, from adapter facts only (never a version number). ``since`` /
    ``removed_in`` state the tested wheels that gives, for people and for the manifest
    test: the first wheel it is installed on, and the first it is no longer installed
    on (``None``: still installed on the newest supported wheel). ``permanent``: no
    upstream change is expected to make it unnecessary.
    """

    when: Callable[[Any], bool]
    since: str
    removed_in: str | None = None
    permanent: bool = False


@dataclass(frozen=True)
class PatchSpec:
    """One replaced attribute. ``target`` is ``"package.module:Owner.attr"`` or ``"package.module:attr"``."""

    name: str
    target: str
    build: Callable[[Any], Any]
    fingerprint: Fingerprint = field(default_factory=Fingerprint)
    # Documentation carried with the patch and printed by ``hybrid-kv doctor``.
    why: str = ""
    upstream: str = ""
    # The vLLM side that calls the patched attribute; a process installs only its sides' patches.
    side: Side = Side.SCHEDULER
    # (object, the scheduler it belongs to) -> True when, for that object's whole life, the
    # replacement only calls the original (its option is off there): see bypass_inert_patches.
    inert_for: Callable[[Any, Any], bool] | None = None

    def resolve(self) -> tuple[Any, str, Any]:
        """Return ``(owner, attribute name, original)`` or raise :class:`PatchMismatch`."""
        module_name, _, path = self.target.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except Exception as exc:  # an import error of a changed wheel is a mismatch too
            raise PatchMismatch(self.target, f"module cannot be imported ({exc!r})") from None
        *owner_path, attr = path.split(".")
        for part in owner_path:
            if not hasattr(owner, part):
                raise PatchMismatch(self.target, f"{part} not found")
            owner = getattr(owner, part)
        if not hasattr(owner, attr):
            raise PatchMismatch(self.target, f"{attr} not found")
        original = inspect.getattr_static(owner, attr)
        if isinstance(original, (staticmethod, classmethod)):
            raise PatchMismatch(self.target, "static/class methods are not patch targets")
        if reason := self.fingerprint.check(original, owner):
            raise PatchMismatch(self.target, reason)
        return owner, attr, original


@dataclass
class _Applied:
    spec: PatchSpec
    owner: Any
    attr: str
    original: Any
    owned: bool  # the attribute lived in the owner's own __dict__ (not inherited)


class PatchSet:
    """Install a list of patches atomically; uninstall restores every original."""

    def __init__(self, specs: Sequence[PatchSpec]):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate patch names in {names}")
        self.specs = tuple(specs)
        self._applied: list[_Applied] = []

    def check(self) -> list[PatchMismatch]:
        """Every mismatch among the targets, without patching anything."""
        problems = []
        for spec in self.specs:
            try:
                spec.resolve()
            except PatchMismatch as exc:
                problems.append(exc)
        return problems

    def install(self) -> None:
        """Patch every target or none. Raises the first :class:`PatchMismatch`.

        Two patches may wrap the same target: each resolves after the previous one is
        installed, so the later wraps the earlier (fingerprints look through wrappers),
        and :meth:`uninstall` unwinds them in reverse order.
        """
        if self._applied:
            return
        self.check_all()
        try:
            for spec in self.specs:
                owner, attr, original = spec.resolve()
                replacement = spec.build(original)
                try:
                    setattr(replacement, PATCH_MARKER, spec.name)
                    # Always set: ``functools.wraps`` copied the wrapped patch's marker.
                    setattr(replacement, INERT_MARKER, spec.inert_for)
                except (AttributeError, TypeError):
                    pass
                owned = isinstance(owner, type) and attr in vars(owner) or not isinstance(owner, type)
                setattr(owner, attr, replacement)
                self._applied.append(_Applied(spec, owner, attr, original, owned))
        except BaseException:
            self.uninstall()
            raise

    def check_all(self) -> None:
        """Raise the first :class:`PatchMismatch` among the targets, patching nothing."""
        if problems := self.check():
            raise problems[0]

    def uninstall(self) -> None:
        while self._applied:
            applied = self._applied.pop()
            if applied.owned:
                setattr(applied.owner, applied.attr, applied.original)
            else:
                delattr(applied.owner, applied.attr)


def then_call(original: Callable[..., Any], after: Callable[[Any], None]) -> Callable[..., Any]:
    """``original`` (a constructor), then ``after(self)`` on the built object: how a feature binds to a scheduler."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        after(self)

    return wrapper


def is_patched(obj: Any) -> bool:
    return hasattr(obj, PATCH_MARKER)


def bypass_inert_patches(obj: Any, attr: str, scheduler: Any) -> bool:
    """Bind method ``attr`` on ``obj`` itself past the outermost patches that are inert for it.

    A patch whose option is off for an engine still costs a call on every use, and its
    targets run every scheduler step. Peeling stops at the first replacement that is not
    a plugin patch inert for ``obj`` (another plugin's, or one whose option is on), so
    only calls that would pass straight through are skipped. True if anything was bound.

    Bound with a plain ``setattr``, never through ``obj.__dict__``: on CPython 3.11 touching
    ``__dict__`` moves the object's attributes out of their inline storage for good, and
    every attribute read and method call on it then takes the slow path (2.4x per access,
    measured). For the same reason only objects already past inline storage (the
    scheduler; the Mamba managers of 0.30+) get a binding: :mod:`hybrid_kv_plugin.inert_patches`.
    """
    method = getattr(type(obj), attr, None)
    target = past_inert_patches(method, obj, scheduler)
    if target is method:
        return False
    setattr(obj, attr, MethodType(target, obj))
    return True


def past_inert_patches(method: Any, obj: Any, scheduler: Any) -> Any:
    """``method`` (a class attribute) with its outermost patches that are inert for ``obj`` peeled off."""
    target = method
    while (inert := getattr(target, INERT_MARKER, None)) is not None and inert(obj, scheduler):
        target = target.__wrapped__
    return target
