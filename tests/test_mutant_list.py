"""``scripts/mutant_list.py`` is well-formed against the current source, so no mutant goes stale silently."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The stock wheels scripts/test builds an environment for (one pins file each).
WHEELS = {p.name.removeprefix("vllm-").removesuffix(".txt") for p in (ROOT / "scripts" / "pins").glob("vllm-[0-9]*.txt")}


def _load(name: str, path: Path):
    # scripts/mutants has no .py suffix: name its loader explicitly.
    spec = importlib.util.spec_from_loader(name, importlib.machinery.SourceFileLoader(name, str(path)))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_every_anchor_occurs_exactly_once_and_every_mutant_names_real_tests():
    mutants = _load("mutant_list", ROOT / "scripts" / "mutant_list.py").MUTANTS
    runner = _load("mutants_runner", ROOT / "scripts" / "mutants")
    names = [m.name for m in mutants]
    assert len(set(names)) == len(names)
    for mutant in mutants:
        assert runner.anchor_problem(mutant) is None
        assert mutant.anchor != mutant.replacement, mutant.name
        assert mutant.tests and set(mutant.wheels) <= WHEELS, mutant.name
        for node in mutant.tests:
            path, _, test = node.partition("::")
            source = (ROOT / path).read_text()
            function = re.sub(r"\[.*\]$", "", test)
            assert re.search(rf"^def {function}\(", source, re.M), f"{mutant.name}: no test {node}"


def test_a_stale_anchor_is_reported(tmp_path):
    runner = _load("mutants_runner", ROOT / "scripts" / "mutants")
    mutant = runner.load_mutants()[0]
    (tmp_path / mutant.file).parent.mkdir(parents=True)
    (tmp_path / mutant.file).write_text(mutant.anchor * 2)
    assert runner.anchor_problem(mutant, tmp_path) == (
        f"{mutant.name}: its anchor occurs 2 times in {mutant.file} (must be exactly once)"
    )
    (tmp_path / mutant.file).write_text("refactored away\n")
    assert runner.anchor_problem(mutant, tmp_path) == (
        f"{mutant.name}: its anchor occurs 0 times in {mutant.file} (must be exactly once)"
    )
