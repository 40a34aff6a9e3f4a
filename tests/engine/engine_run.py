"""Driving the real engine: build it, run one request, read its hits and the metrics it exported."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_kv_plugin import CONNECTOR_NAME

# Knobs measured for this machine: one process (the tests reach the engine core and its
# connector in-process), no OpenMP thread binding, 1 GiB of "device" KV cache, no network.
ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
FORCED = ("VLLM_ENABLE_V1_MULTIPROCESSING",)  # the tests need it; the others yield to the caller's own value


def engine_environment() -> None:
    """Set the engine knobs in this process's environment; call it before vLLM is imported
    (vLLM reads them at import and engine start). Importing this module imports no vLLM."""
    for name, value in ENGINE_ENVIRONMENT.items():
        if name in FORCED:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


@dataclass(frozen=True)
class EngineGeometry:
    attention_block_size: int = 32
    # vLLM 0.32 sets the Mamba block to the attention block in "align" mode
    # (vllm/platforms/interface.py, `cache_config.mamba_block_size = cache_config.block_size`).
    mamba_block_size: int = 32
    prefix_match_unit: int = 16
    max_model_len: int = 2048
    cpu_bytes_to_use: int = 256 << 20
    # The CPU gated-delta-net kernel takes nothing else ("CPU GDN attention requires BF16.").
    dtype: str = "bfloat16"
    # Its recurrent state: vLLM's CPU platform picks float32 for "auto" only on some hosts
    # (0.29+: AVX-512 BF16; 0.27-0.28: AMX only), and the 0.28 kernel refuses a bf16 state
    # ("initial_state dtype mismatch"). Named, so every host and wheel runs the same state.
    mamba_ssm_cache_dtype: str = "float32"


ENGINE_GEOMETRY = EngineGeometry()
MAX_TOKENS = 4


@dataclass(frozen=True)
class Completion:
    """What one greedy request produced, and how many of its prompt tokens it did not compute."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    num_cached_tokens: int
    local_hits: int  # growth of vllm:prefix_cache_hits during the request
    external_hits: int  # growth of vllm:external_prefix_cache_hits during the request


def build_llm(model_dir: Path, geometry: EngineGeometry, **overrides: Any):
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        distributed_executor_backend="uni",
        block_size=geometry.attention_block_size,
        mamba_block_size=geometry.mamba_block_size,
        mamba_cache_mode="align",
        enable_prefix_caching=True,
        prefix_match_unit=geometry.prefix_match_unit,
        max_model_len=geometry.max_model_len,
        dtype=geometry.dtype,
        mamba_ssm_cache_dtype=geometry.mamba_ssm_cache_dtype,
        disable_log_stats=False,  # LLM.get_metrics() needs the stat loggers
        seed=0,
        kv_transfer_config={
            "kv_connector": CONNECTOR_NAME,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": geometry.cpu_bytes_to_use},
        },
    )
    kwargs.update(overrides)
    return LLM(**kwargs)


@contextlib.contextmanager
def running_llm(model_dir: Path, geometry: EngineGeometry, **overrides: Any) -> Iterator[Any]:
    """:func:`build_llm`, shut down on the way out."""
    llm = build_llm(model_dir, geometry, **overrides)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def async_scheduling_kept(enabled: bool = True) -> Iterator[None]:
    """Engines built inside keep ``async_scheduling`` as requested, so they run ``AsyncScheduler``
    (``enabled`` False: nothing changes, for callers that choose the scheduler by a parameter).

    vLLM's CPU platform turns it off for every engine ("async scheduling is not required on
    CPU"); here ``CpuPlatform.check_and_update_config`` runs unchanged, then the requested
    value is put back (test-only: a GPU ``vllm serve`` runs ``AsyncScheduler`` by default).
    """
    if not enabled:
        yield
        return
    import pytest
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config

    def check_and_update_config(cls, vllm_config):
        requested = vllm_config.scheduler_config.async_scheduling
        original(vllm_config)
        vllm_config.scheduler_config.async_scheduling = requested

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuPlatform, "check_and_update_config", classmethod(check_and_update_config))
        yield


def counters(llm) -> dict[str, float]:
    """Every counter the engine exported, ``name`` or ``name{label=value}`` for labelled outcomes."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if type(metric).__name__ != "Counter":
            continue
        key = metric.name
        if "outcome" in metric.labels:
            key += "{" + metric.labels["outcome"] + "}"
        values[key] = values.get(key, 0) + metric.value
    return values


def greedy_params(max_tokens: int = MAX_TOKENS) -> Any:
    """Greedy sampling of ``max_tokens`` tokens, the chosen token's logprob returned with each."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)


def tokens_prompt(tokens: Sequence[int], cache_salt: str | None = None) -> Any:
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=list(tokens))
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    return request


def output_record(output: Any) -> dict[str, Any]:
    """A finished request's output as JSON-ready data: its hit, tokens and their logprobs."""
    sample = output.outputs[0]
    return {
        "num_cached_tokens": output.num_cached_tokens,
        "token_ids": list(sample.token_ids),
        "logprobs": [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)],
    }


def generate_records(llm, batch: Sequence[Sequence[int]], cache_salt: str | None = None) -> list[dict[str, Any]]:
    """One ``generate`` call for every prompt of ``batch`` (admitted together), as :func:`output_record` data."""
    outputs = llm.generate([tokens_prompt(tokens, cache_salt) for tokens in batch], greedy_params(), use_tqdm=False)
    return [output_record(output) for output in outputs]


def generate(llm, prompt: list[int], cache_salt: str | None = None, max_tokens: int = MAX_TOKENS) -> Completion:
    before = counters(llm)
    (output,) = llm.generate([tokens_prompt(prompt, cache_salt)], greedy_params(max_tokens), use_tqdm=False)
    after = counters(llm)
    record = output_record(output)
    growth = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return Completion(
        token_ids=tuple(record["token_ids"]),
        logprobs=tuple(record["logprobs"]),
        num_cached_tokens=record["num_cached_tokens"],
        local_hits=int(growth.get("vllm:prefix_cache_hits", 0)),
        external_hits=int(growth.get("vllm:external_prefix_cache_hits", 0)),
    )


def like_for_like(llm, producer: list[int], consumer: list[int], hit: int, salt: str) -> Completion:
    """``consumer`` computed from token 0 in the same chunks as a cached run of it that hit ``hit``.

    bf16 kernels round by chunk (on an AMX host a suffix-only run and a whole-prompt run emit
    different tokens), so a reference must end a prefill chunk where the cached run's hit
    ends and compute the same suffix. Under a fresh salt, first: ``producer`` (the request
    whose cold run left the state the cached run started from: the same prompt, so the same
    chunks), then ``consumer`` from the GPU prefix cache. Where the wheel's GPU cache keeps no
    state at ``hit`` (0.29: a prompt's tail state sits at its end, past any replay), under a
    second salt: ``consumer[:hit + 1]``, whose prompt-tail split (the last hash boundary at or
    below its length - 1 on every wheel here) falls at ``hit``, then ``consumer``. Either way
    the reference's hit must be exactly ``hit`` (asserted).
    """
    generate(llm, producer, cache_salt=salt)
    reference = generate(llm, consumer, cache_salt=salt)
    if reference.num_cached_tokens != hit:
        return cut_at_hit(llm, consumer, hit, salt + "-cut")
    return reference


def cut_at_hit(llm, consumer: list[int], hit: int, salt: str) -> Completion:
    """``consumer`` with a prefill chunk [0, hit) computed from scratch: under ``salt``, ``consumer[:hit + 1]``
    (split at ``hit``, see ``like_for_like``), then ``consumer``, which must hit exactly ``hit``."""
    generate(llm, consumer[: hit + 1], cache_salt=salt, max_tokens=1)
    reference = generate(llm, consumer, cache_salt=salt)
    assert reference.num_cached_tokens == hit, (salt, reference.num_cached_tokens, hit)
    return reference


def start_in_child(model_dir: Path, additional_config: dict, timeout_s: float = 1200) -> dict:
    """How an engine start with ``additional_config`` ends, in a child process (``refusal.py``)."""
    import json

    script = Path(__file__).with_name("refusal.py")
    return child_result([str(script), str(model_dir), json.dumps(additional_config)], "ENGINE_START", timeout_s)


def stock_result(script: str, model_dir: Path, marker: str, *args: str, timeout_s: float = 1200) -> Any:
    """``python SCRIPT MODEL_DIR ARGS`` with the plugin disabled (stock vLLM: the plugin is registered
    once per process, so stock runs in a child); what it printed after ``marker``."""
    return child_result([script, str(model_dir), *args], marker, timeout_s, {"HYBRID_KV_PLUGIN_DISABLE": "1"})


def child_result(args: list[str], marker: str, timeout_s: float, env: dict[str, str] | None = None) -> Any:
    """``python ARGS`` in a child process (``env`` added to this one's); the JSON it printed after ``marker``."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, *args], env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker + " ")]
    assert done.returncode == 0 and len(lines) == 1, done.stderr[-4000:]
    return json.loads(lines[0].split(" ", 1)[1])


def report_to_parent(model_dir: Path, geometry: EngineGeometry, run: Any, marker: str, **overrides: Any) -> None:
    """In a child process: ``run`` on a fresh engine, then print ``MARKER <json>`` (read by :func:`stock_result`)."""
    import json

    with running_llm(model_dir, geometry, **overrides) as llm:
        result = run(llm)
    print(f"{marker} {json.dumps(result)}", flush=True)


def assert_outputs_match_references(runs: dict, length: int, phases: tuple[str, ...]) -> None:
    """The cold run equals the salted uncached run, and each phase its like-for-like reference, exactly."""
    uncached, cold = runs[length, "uncached"], runs[length, "cold"]
    assert (uncached.num_cached_tokens, cold.num_cached_tokens) == (0, 0)
    assert (cold.token_ids, cold.logprobs) == (uncached.token_ids, uncached.logprobs)
    for phase in phases:
        run, reference = runs[length, phase], runs[length, phase, "reference"]
        assert (run.token_ids, run.logprobs) == (reference.token_ids, reference.logprobs), phase
