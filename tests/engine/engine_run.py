"""Driving the real engine: build it, run one request, read its hits and the metrics it exported."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_kv_plugin import CONNECTOR_NAME


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


def generate(llm, prompt: list[int], cache_salt: str | None = None, max_tokens: int = MAX_TOKENS) -> Completion:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    request = TokensPrompt(prompt_token_ids=list(prompt))
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    before = counters(llm)
    (output,) = llm.generate([request], params, use_tqdm=False)
    after = counters(llm)
    sample = output.outputs[0]
    growth = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return Completion(
        token_ids=tuple(sample.token_ids),
        logprobs=tuple(step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)),
        num_cached_tokens=output.num_cached_tokens,
        local_hits=int(growth.get("vllm:prefix_cache_hits", 0)),
        external_hits=int(growth.get("vllm:external_prefix_cache_hits", 0)),
    )
