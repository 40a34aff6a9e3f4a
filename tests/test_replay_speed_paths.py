"""The replay's fast paths give exactly what the slow definitions give.

- Mamba states held (``sim/mamba_states.py``): the tallies kept as block keys change equal a
  full scan of both pools at every sample, through CPU evictions and GPU prefix-cache resets.
- The byte check's decode step (``sim/byte_cache.py``): a prefix hash grown one token at a
  time equals the hash of the whole prefix at once, bit for bit.
- ``replay --jobs N``: configurations in processes of their own report the same numbers as
  one after another in one process; bad values are one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import random

import numpy as np
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from hybrid_kv_plugin.cli.main import console_main
from hybrid_kv_plugin.connector_names import STOCK_CONNECTOR_NAME
from hybrid_kv_plugin.sim.byte_cache import _Powers, _Prefix, prefix_hashes
from hybrid_kv_plugin.sim.configs import CONFIGS
from hybrid_kv_plugin.sim.mamba_states import MambaStateCounter, held_by_scan
from hybrid_kv_plugin.sim.replay import ReplaySettings, replay
from hybrid_kv_plugin.sim.workload import default_workload
from scenarios.offload import offload_engine
from scenarios.prompt_tail import mamba_states_held


# ---------------------------------------------------------------------------- Mamba states held
def test_kept_counts_equal_a_full_scan_at_every_sample(monkeypatch):
    compared = []
    sample = MambaStateCounter.sample

    def scanned_sample(self):
        gpu, cpu = self.held()
        cpu_pool = self._cpu_pool()
        assert gpu == held_by_scan(self.gpu_pool, self._suffixes)
        assert cpu == (None if cpu_pool is None else held_by_scan(cpu_pool, self._suffixes))
        compared.append((gpu, cpu))
        sample(self)

    monkeypatch.setattr(MambaStateCounter, "sample", scanned_sample)
    samples = evictions = 0
    # A CPU tier of 64 blocks evicts; the workload resets the GPU prefix cache before turns 1 and 3.
    for name in ("stock", "plugin"):
        result = replay(default_workload(), ReplaySettings(cpu_blocks=64), CONFIGS[name])
        samples += sum(s.mamba_states["gpu"]["samples"] for s in result.segments)
        evictions += sum(s.cpu_evictions for s in result.segments)
    assert len(compared) == samples
    assert evictions > 0
    assert max(gpu for gpu, _ in compared) > 0 and max(cpu for _, cpu in compared) > 0


def test_a_prefix_cache_reset_leaves_the_gpu_tally_at_the_scan(adapter, no_plugin):
    run = offload_engine(adapter, STOCK_CONNECTOR_NAME, byte_check=False)
    engine = run.engine
    counter = MambaStateCounter(engine)
    for number, prompt in enumerate((tuple(range(1, 300)), tuple(range(1, 200)) + tuple(range(900, 1000)))):
        engine.run([(f"r{number}", prompt)], max_tokens=3)
    held = counter.held()
    assert held[0] == mamba_states_held(engine) > 0
    assert held[1] == held_by_scan(engine.offload_manager.cpu_block_pool, counter._suffixes)
    assert engine.reset_prefix_cache()
    assert counter.held()[0] == mamba_states_held(engine) == 0
    # The counted blocks are still vLLM's blocks: same class family, no new slot.
    block = engine.gpu_block_pool.blocks[1]
    assert isinstance(block, KVCacheBlock) and type(block).__slots__ == ()


# ---------------------------------------------------------------------------- the byte check's hashes
def test_a_prefix_hash_grown_token_by_token_equals_the_whole_prefix_at_once():
    rng = random.Random(7)
    tokens = [rng.randrange(0, 32000) for _ in range(9000)]  # past the 4096 powers first built
    whole = prefix_hashes(tokens)
    prefix, powers = _Prefix(), _Powers()
    stop = 0
    for step in [1] * 700 + [37, 1, 1, 513, 8, 1] + [1] * 8000:
        stop = min(stop + step, len(tokens))
        grown = prefix.upto(tokens, stop, powers)
    assert stop == len(tokens) and np.array_equal(grown, whole)
    # A decode token the scheduler does not have yet (async scheduling) is the pad.
    padded = _Prefix()
    padded.upto(tokens[:100], 100, powers)
    assert np.array_equal(padded.upto(tokens[:100], 101, powers, pad=5), prefix_hashes(tokens[:100] + [5]))


# ---------------------------------------------------------------------------- --jobs
def _report(capsys, *argv):
    assert console_main(["replay", "--configs", "stock,plugin", "--json", *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    for row in report["results"]:
        row.pop("timing")
    report.pop("startup_s")
    return report


def test_jobs_run_configurations_in_processes_with_the_same_numbers(capsys):
    assert _report(capsys, "--jobs", "2") == _report(capsys)


def test_bad_jobs_is_one_line_and_exit_2(capsys):
    assert console_main(["replay", "--jobs", "0"]) == 2
    assert capsys.readouterr() == ("", "hybrid-kv: --jobs must be >= 1, got 0\n")
    assert console_main(["replay", "--jobs", "2", "--engines", "2"]) == 2
    assert capsys.readouterr() == (
        "",
        "hybrid-kv: --jobs runs the configurations of a single-engine replay in parallel; "
        "it does not apply with --engines\n",
    )
