"""The plugin's user-facing configuration, validated by pydantic.

Two places carry it, both present on every supported wheel:

* ``--additional-config '{"hybrid_kv": {...}}'`` (``VllmConfig.additional_config``)
  for engine-wide switches (:class:`PluginConfig`);
* ``--kv-transfer-config '{..., "kv_connector_extra_config": {...}}'`` for the
  connector's own options (:class:`ConnectorOptions`).

Invalid input raises :class:`PluginConfigError` at start-up; its message names
the offending key and the values it accepts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ADDITIONAL_CONFIG_KEY = "hybrid_kv"
ENV_DISABLE = "HYBRID_KV_PLUGIN_DISABLE"
ENV_SHARED_PREFIX_CHECKPOINT = "HYBRID_KV_MAMBA_SHARED_PREFIX_CHECKPOINT"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class PluginConfigError(ValueError):
    """A plugin option is unknown or has a value outside what it accepts."""


class PluginConfig(BaseModel):
    """Options under ``additional_config["hybrid_kv"]``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    mamba_shared_prefix_checkpoint: bool = Field(
        default=False,
        description="Cache the Mamba state at the shared-prefix junction under EAGLE "
        "(one extra state block per junction).",
    )
    async_load_liveness: bool = Field(
        default=True,
        description="Keep the scheduler's waiting scan live around async KV loads (every wheel: a load "
        "landing inside a Mamba block reserves its copy; with deferred block frees, as under async "
        "scheduling with a KV-loading connector, an admission leaves the running prefills' remaining "
        "blocks free; vLLM 0.29+ after a failed load: drop stale in-flight reservations, scan block "
        "holders first).",
    )
    prompt_tail_checkpoint: Literal["native", "replay", "both"] = Field(
        default="native",
        description="Where the prompt-tail Mamba state is kept (align mode): native = the wheel's "
        "own position; replay = the last hash boundary <= N-1 (exact replays hit); both = that "
        "boundary and the prompt's last one (exact replays and continuations hit; one extra "
        "prefill chunk and Mamba block per request). See hybrid_kv_plugin.prompt_tail.",
    )
    mamba_output_checkpoint: bool = Field(
        default=False,
        description="Keep the Mamba state at the last prefix-match-unit boundary of each answer (align "
        "mode, vLLM 0.29+), so a conversation's next turn reuses the previous answer; at most one extra "
        "Mamba block per running request. See hybrid_kv_plugin.output_checkpoint.",
    )
    mamba_divergence_checkpoint: bool = Field(
        default=False,
        description="Without EAGLE: attention blocks are keyed at every prefix-match unit, and when a "
        "request's prefix lookup finds attention KV past the deepest Mamba state it can load, its prefill "
        "ends a chunk there and keeps the Mamba state, so the next request sharing that prefix resumes "
        "there (align mode, partial hash hits; at most one extra chunk and Mamba block per divergence). "
        "See hybrid_kv_plugin.divergence.",
    )


class ConnectorOptions(BaseModel):
    """The plugin's own options of ``HybridSimpleCPUConnector`` in ``kv_connector_extra_config``.

    The stock SimpleCPU keys of the installed wheel (``cpu_bytes_to_use``,
    ``lazy_offload``, ...) are passed through to vLLM untouched; the adapter names
    them, so any other key is reported as unknown instead of silently ignored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    fine_grained_hits: bool = Field(
        default=True,
        description="Load hash-granular external hits for hybrid attention + Mamba align models.",
    )
    cpu_tier_eviction: Literal["lru", "hybrid"] = Field(
        default="lru",
        description="Eviction order of the CPU tier: lru = the wheel's own; hybrid = copies a request "
        "reuses from the GPU cache count as used, and chunk-end Mamba states inside a prompt are "
        "evicted first (needs the fine-grained hybrid connector, vLLM 0.29+). "
        "See hybrid_kv_plugin.offload.eviction.",
    )
    cpu_tier_request_ends: Literal["auto", "store", "skip"] = Field(
        default="auto",
        description="Whether the CPU tier takes a request's own end state when it lies off the Mamba block "
        "grid (the prompt's last unit boundary, the newest kept answer state, and the attention block holding "
        "it); it serves only the same conversation's next turn, and a tier that turns over faster than "
        "conversations continue loses other requests' KV to it (the GPU cache keeps it either way). "
        "auto = store until the tier first evicts, skip from then on; store = always; skip = never "
        "(skip needs the fine-grained hybrid connector, vLLM 0.29+; auto does nothing without it). "
        "See hybrid_kv_plugin.offload.admission.",
    )


def _describe_error(prefix: str, model: type[BaseModel], err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(model.model_fields))
            lines.append(f"{prefix}.{key}: unknown key (allowed keys: {allowed})")
            continue
        field = model.model_fields.get(str(item["loc"][0])) if item["loc"] else None
        allowed = _allowed_values(field.annotation) if field is not None else ""
        lines.append(f"{prefix}.{key}: {item['msg']} (got {item.get('input')!r}; allowed: {allowed})")
    return "invalid hybrid-kv-plugin configuration: " + "; ".join(lines)


def _allowed_values(annotation: Any) -> str:
    if annotation is bool:
        return "true or false"
    if get_origin(annotation) is Literal:
        values = [str(v) for v in get_args(annotation)]
        return ", ".join(values[:-1]) + " or " + values[-1]
    return getattr(annotation, "__name__", None) or str(annotation)


def _validate(model: type[BaseModel], prefix: str, raw: Any) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise PluginConfigError(
            f"invalid hybrid-kv-plugin configuration: {prefix} must be a JSON object, "
            f"got {type(raw).__name__} (allowed keys: {', '.join(sorted(model.model_fields))})"
        )
    try:
        return model.model_validate(dict(raw))
    except ValidationError as err:
        raise PluginConfigError(_describe_error(prefix, model, err)) from None


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """Parse a boolean environment variable; ``None`` when unset. Bad values raise."""
    environ = os.environ if environ is None else environ
    if name not in environ:
        return None
    value = environ[name].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise PluginConfigError(
        f"invalid hybrid-kv-plugin configuration: environment variable {name}={environ[name]!r} "
        "(allowed: 1, 0, true, false, yes, no, on, off)"
    )


def plugin_config_from(
    additional_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> PluginConfig:
    """Read ``additional_config["hybrid_kv"]``, then apply environment overrides."""
    section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    config = _validate(PluginConfig, ADDITIONAL_CONFIG_KEY, section)
    override = env_flag(ENV_SHARED_PREFIX_CHECKPOINT, environ)
    if override is not None:
        config = config.model_copy(update={"mamba_shared_prefix_checkpoint": override})
    return config


def check_switch_needs_eagle(
    switch: bool, method: str | None, uses_eagle: bool, environ: Mapping[str, str] | None = None
) -> None:
    """The junction switch on an engine without EAGLE is a conflict: refuse it at start-up.

    The junction checkpoint exists for EAGLE's one-unit block drop; without a drafter
    that reads target hidden states (``SpeculativeConfig.use_eagle()``) it could never
    act. ``switch``: ``mamba_shared_prefix_checkpoint`` as validated (environment
    override applied); ``method``: the speculative method, None without speculative decoding.
    """
    if not switch or uses_eagle:
        return
    environ = os.environ if environ is None else environ
    source = (
        f"environment variable {ENV_SHARED_PREFIX_CHECKPOINT}={environ[ENV_SHARED_PREFIX_CHECKPOINT]!r}"
        if env_flag(ENV_SHARED_PREFIX_CHECKPOINT, environ)
        else f"{ADDITIONAL_CONFIG_KEY}.mamba_shared_prefix_checkpoint: true"
    )
    has = f"speculative method {method!r}" if method is not None else "no speculative decoding"
    raise PluginConfigError(
        f"invalid hybrid-kv-plugin configuration: {source} needs EAGLE-style speculative decoding "
        f"(--speculative-config method eagle, eagle3 or mtp) and this engine has {has} "
        "(allowed without EAGLE: false)"
    )


def check_prompt_tail_supported(value: str, supported: bool, vllm_version: str, first_wheel: str) -> None:
    """A non-native ``prompt_tail_checkpoint`` on a wheel without the Mamba partial-tail machinery stops start-up.

    ``first_wheel``: the first tested wheel that supports it (the adapter layer says which).
    """
    if value == "native" or supported:
        return
    raise PluginConfigError(
        f"invalid hybrid-kv-plugin configuration: {ADDITIONAL_CONFIG_KEY}.prompt_tail_checkpoint: {value!r} "
        f"needs vLLM >= {first_wheel} and this is vLLM {vllm_version} (allowed here: native)"
    )


def check_output_checkpoint_supported(value: bool, supported: bool, vllm_version: str, first_wheel: str) -> None:
    """``mamba_output_checkpoint`` on a wheel whose Mamba manager cannot keep a running request's state stops start-up.

    ``first_wheel``: as for :func:`check_prompt_tail_supported`.
    """
    if not value or supported:
        return
    raise PluginConfigError(
        f"invalid hybrid-kv-plugin configuration: {ADDITIONAL_CONFIG_KEY}.mamba_output_checkpoint: true "
        f"needs vLLM >= {first_wheel} and this is vLLM {vllm_version} (allowed here: false)"
    )


def check_divergence_supported(value: bool, supported: bool, vllm_version: str, first_wheel: str) -> None:
    """``mamba_divergence_checkpoint`` on a wheel that cannot keep a state at the divergence point stops start-up.

    ``first_wheel``: the first tested wheel that supports it (the adapter layer says which).
    """
    if not value or supported:
        return
    raise PluginConfigError(
        f"invalid hybrid-kv-plugin configuration: {ADDITIONAL_CONFIG_KEY}.mamba_divergence_checkpoint: true "
        f"needs vLLM >= {first_wheel} and this is vLLM {vllm_version} (allowed here: false)"
    )


def connector_options_from(
    extra_config: Mapping[str, Any] | None, stock_keys: frozenset[str]
) -> ConnectorOptions:
    """Validate the plugin's keys; any key neither ours nor the wheel's stock one is an error."""
    if extra_config is not None and not isinstance(extra_config, Mapping):
        return _validate(ConnectorOptions, "kv_connector_extra_config", extra_config)
    ours = {k: v for k, v in (extra_config or {}).items() if k not in stock_keys}
    if problems := stock_key_problems(extra_config or {}, stock_keys):
        raise PluginConfigError("invalid hybrid-kv-plugin configuration: " + "; ".join(problems))
    try:
        options = ConnectorOptions.model_validate(ours)
    except ValidationError as err:
        message = _describe_error("kv_connector_extra_config", ConnectorOptions, err)
        if any(item["type"] == "extra_forbidden" for item in err.errors()):
            message += f"; this vLLM's SimpleCPU keys: {', '.join(sorted(stock_keys))}"
        raise PluginConfigError(message) from None
    # Lazy offload stores evicted blocks, never the Mamba boundary states fine-grained hits
    # need; asking for both explicitly is a conflict (unset, lazy mode serves coarse hits).
    if "fine_grained_hits" in options.model_fields_set and options.fine_grained_hits and (extra_config or {}).get("lazy_offload") is True:
        raise PluginConfigError(
            "invalid hybrid-kv-plugin configuration: kv_connector_extra_config.fine_grained_hits: true "
            "conflicts with lazy_offload: true (lazy offload stores no Mamba boundary states, so CPU hits "
            "stay on whole scheduler blocks); allowed: fine_grained_hits false or unset with lazy offload, "
            "or lazy_offload false"
        )
    return options


# Every environment variable the plugin reads, and what it does; `hybrid-kv doctor` checks each.
PLUGIN_ENVIRONMENT: dict[str, str] = {
    ENV_DISABLE: "1: vLLM runs stock (nothing patched, connector not registered)",
    ENV_SHARED_PREFIX_CHECKPOINT: "overrides hybrid_kv.mamba_shared_prefix_checkpoint",
}


def environment_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per plugin environment variable whose value the plugin would refuse or misread."""
    problems = []
    for name in PLUGIN_ENVIRONMENT:
        try:
            env_flag(name, environ)
        except PluginConfigError as err:
            problems.append(str(err).removeprefix("invalid hybrid-kv-plugin configuration: "))
    return problems


def plugin_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``HYBRID_KV_PLUGIN_DISABLE``: a malformed value disables too, and says so."""
    try:
        return bool(env_flag(ENV_DISABLE, environ))
    except PluginConfigError:
        return True


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and value == int(value)


# The wheel's SimpleCPU reads these keys with bare bool()/int()/str() conversions, so a
# mistyped value does not fail: "lazy_offload": "false" turns lazy offload *on*, a
# cpu_bytes_to_use of 0 silently sizes a one-block CPU pool. The plugin's connector
# checks what it passes through; keys this wheel does not read are not in stock_keys.
_STOCK_KEY_RULES: dict[str, tuple[str, Any]] = {
    "cpu_bytes_to_use": ("a positive integer", _positive_number),
    "cpu_bytes_to_use_per_rank": ("a positive integer", _positive_number),
    "disk_capacity_bytes": ("a positive integer", _positive_number),
    "disk_buffer_slots": ("a positive integer", _positive_number),
    "num_cpu_blocks": ("a positive integer or null", lambda v: v is None or _positive_number(v)),
    "lazy_offload": ("true or false", lambda v: isinstance(v, bool)),
    "use_page_cache": ("true or false", lambda v: isinstance(v, bool)),
    "kv_offload_backend": ("a string", lambda v: isinstance(v, str)),
    "disk_path": ("a string or null", lambda v: v is None or isinstance(v, str)),
}


def stock_key_problems(extra_config: Mapping[str, Any], stock_keys: frozenset[str]) -> list[str]:
    """One line per stock SimpleCPU key of this wheel whose value vLLM would misread."""
    problems = []
    for key in sorted(stock_keys & set(extra_config)):
        allowed, ok = _STOCK_KEY_RULES.get(key, ("", None))
        if ok is not None and not ok(extra_config[key]):
            problems.append(f"kv_connector_extra_config.{key}: got {extra_config[key]!r} (allowed: {allowed})")
    return problems
