"""The KV-cache geometry a real model gets on this wheel, resolved by vLLM's own config code.

From a local model directory (``config.json`` only: no weights, no tokenizer) and the
``vllm serve`` flags that shape the cache, this builds the wheel's real ``ModelConfig`` /
``CacheConfig`` / ``VllmConfig`` and then runs the hybrid block-size alignment a CUDA worker
runs once its attention backend is known (``Platform._align_hybrid_block_size`` with the
FlashAttention backend, the CUDA default for these models). The pool sizes come from the
wheel's KV-cache planner over one spec per layer, for the given KV-cache memory; the CPU
tier holds ``cpu_bytes_to_use`` worth of the same blocks (SimpleCPU's own sizing rule).

Every refusal is a :class:`GeometryError` on one line: vLLM's message, or where vLLM's own
words name no config field or flag, the field and what would work (:mod:`.refusals`).
vLLM inspects the model class in this process, without torchvision (:mod:`.inspection`).
This package never imports the simulator: ``doctor`` resolves a geometry without it.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict, dataclass
from typing import Any

GIB = 1 << 30
DEFAULT_GPU_KV_GIB = 40.0
DEFAULT_CPU_GIB = 160.0


class GeometryError(ValueError):
    """A geometry vLLM refuses, or a serve line that cannot be read; one line."""


@dataclass(frozen=True)
class ModelGeometry:
    """What the engine would run with; sizes in tokens unless named ``_bytes``."""

    model: str
    architecture: str
    attention_block_size: int
    mamba_block_size: int
    hash_block_size: int
    mamba_cache_mode: str
    max_model_len: int
    attention_layers: int
    mamba_layers: int
    page_bytes: int  # one block of one layer (attention page = padded Mamba page)
    block_bytes: int  # GPU KV memory per block (what one block costs across all layers)
    gpu_blocks: int
    cpu_blocks: int
    gpu_kv_bytes: int
    cpu_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int
    # KV-cache groups of Mamba layers the planner made: the pool blocks one Mamba state takes.
    mamba_groups: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServeLine:
    """The cache-shaping flags of a ``vllm serve`` line; None where not given."""

    model: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    mamba_block_size: int | None = None
    prefix_match_unit: int | None = None
    mamba_cache_mode: str | None = None
    enable_prefix_caching: bool | None = None
    tensor_parallel_size: int = 1
    kv_cache_memory_bytes: int | None = None
    cpu_bytes_to_use: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None


def _bytes(text: str) -> int:
    """``123``, ``40G``/``40GiB`` (GiB), ``512M``/``512MiB`` (MiB)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(value[-1:], 1)
    if scale != 1:
        value = value[:-1]
    try:
        return int(float(value) * scale)
    except ValueError:
        raise GeometryError(f"not a byte count: {text!r}") from None


def parse_serve_line(argv: list[str] | str) -> ServeLine:
    """Read the flags above from a serve line (``vllm serve MODEL ...`` or just the flags)."""
    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    if argv[:2] == ["vllm", "serve"]:
        argv = argv[2:]
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--max-model-len", type=str)
    p.add_argument("--block-size", type=int)
    p.add_argument("--mamba-block-size", type=int)
    p.add_argument("--prefix-match-unit", type=int)
    p.add_argument("--mamba-cache-mode")
    p.add_argument("--enable-prefix-caching", action="store_true", default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory")
    p.add_argument("--kv-transfer-config")
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--kv-cache-dtype")
    try:
        args, _ = p.parse_known_args(argv)
    except (argparse.ArgumentError, ValueError) as exc:
        raise GeometryError(f"serve line: {exc}") from None
    cpu_bytes = None
    if args.kv_transfer_config:
        try:
            kv = json.loads(args.kv_transfer_config)
            extra = kv.get("kv_connector_extra_config") or {}
            if "cpu_bytes_to_use" in extra:
                cpu_bytes = int(extra["cpu_bytes_to_use"])
        except (ValueError, AttributeError, TypeError) as exc:
            raise GeometryError(f"--kv-transfer-config: {exc}") from None
    max_len = None
    if args.max_model_len is not None:
        max_len = _bytes(args.max_model_len) if args.max_model_len[-1:].isalpha() else int(args.max_model_len)
    return ServeLine(
        model=args.model or args.model_tag,
        max_model_len=max_len,
        block_size=args.block_size,
        mamba_block_size=args.mamba_block_size,
        prefix_match_unit=args.prefix_match_unit,
        mamba_cache_mode=args.mamba_cache_mode,
        enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_memory_bytes=_bytes(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes else None,
        cpu_bytes_to_use=cpu_bytes,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def one_line(exc: BaseException) -> str:
    """vLLM's own message, without pydantic's framing or a traceback."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            message = str(first.get("msg", exc))
            return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        except Exception:  # noqa: BLE001 - fall back to the plain text
            pass
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def resolve(
    serve: ServeLine,
    *,
    gpu_kv_bytes: int | None = None,
    cpu_bytes: int | None = None,
) -> ModelGeometry:
    """Resolve ``serve`` (its ``model`` a local directory with a ``config.json``) on this wheel."""
    import os

    if not serve.model:
        raise GeometryError("no model: give --model DIR or a serve line naming one")
    if not os.path.isfile(os.path.join(serve.model, "config.json")):
        raise GeometryError(f"{serve.model}: no config.json there (a local model directory is needed)")
    from hybrid_kv_plugin.models.environment import offline_environment
    from hybrid_kv_plugin.models.inspection import model_inspection
    from hybrid_kv_plugin.models.refusals import explain

    offline_environment()
    try:
        with model_inspection():
            return _resolve(serve, gpu_kv_bytes, cpu_bytes)
    except GeometryError:
        raise
    except Exception as exc:  # noqa: BLE001 - vLLM refuses with many exception types
        line = explain(serve, exc, one_line(exc))
    raise GeometryError(line + _unit_hint(serve, gpu_kv_bytes, cpu_bytes))


def _unit_hint(serve: ServeLine, gpu_kv_bytes: int | None, cpu_bytes: int | None) -> str:
    """Where the geometry resolves without the given ``--prefix-match-unit``, the blocks it must divide."""
    if serve.prefix_match_unit is None:
        return ""
    from dataclasses import replace

    try:
        plain = resolve(replace(serve, prefix_match_unit=None), gpu_kv_bytes=gpu_kv_bytes, cpu_bytes=cpu_bytes)
    except GeometryError:
        return ""  # refused for another reason too; vLLM's line stands alone
    from hybrid_kv_plugin.models.unit_grid import accepted_units

    units = accepted_units(plain)
    return (
        f" -- in plain words: --prefix-match-unit {serve.prefix_match_unit} must divide the "
        f"{plain.attention_block_size}-token attention block and the {plain.mamba_block_size}-token Mamba block "
        f"vLLM resolves for {plain.architecture}; units that do: {', '.join(map(str, units))}"
    )


def _resolve(serve: ServeLine, gpu_kv_bytes: int | None, cpu_bytes: int | None) -> ModelGeometry:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from hybrid_kv_plugin.models.refusals import PREFIX, removed_architecture

    removed = removed_architecture(serve.model)
    if removed:  # vLLM would fall back to its generic Transformers backend, which is no hybrid
        raise GeometryError(PREFIX + removed)
    model_config = ModelConfig(model=serve.model, skip_tokenizer_init=True, max_model_len=serve.max_model_len)
    if not model_config.is_hybrid:
        raise GeometryError(f"{serve.model}: {model_config.architecture} is not a hybrid (attention + Mamba) model")
    caching = serve.enable_prefix_caching is not False
    cache_kwargs: dict[str, Any] = {"enable_prefix_caching": caching}
    for name in ("block_size", "mamba_block_size", "prefix_match_unit", "kv_cache_dtype"):
        value = getattr(serve, name)
        if value is not None:
            cache_kwargs["cache_dtype" if name == "kv_cache_dtype" else name] = value
    # vLLM's serve picks align for hybrid models once prefix caching is on.
    cache_kwargs["mamba_cache_mode"] = serve.mamba_cache_mode or ("align" if caching else "none")
    cache_config = CacheConfig(**cache_kwargs)
    parallel_config = ParallelConfig(tensor_parallel_size=serve.tensor_parallel_size)
    scheduler_kwargs: dict[str, Any] = {"max_model_len": model_config.max_model_len, "is_encoder_decoder": False}
    scheduler_kwargs["max_num_batched_tokens"] = serve.max_num_batched_tokens or 8192
    scheduler_kwargs["max_num_seqs"] = serve.max_num_seqs or 256
    scheduler_config = SchedulerConfig(**scheduler_kwargs)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
    )
    Platform._align_hybrid_block_size(vllm_config, FlashAttentionBackend)
    attention_layers, mamba_layers = _layer_counts(model_config, parallel_config)
    if not (attention_layers and mamba_layers):
        raise GeometryError(
            f"{serve.model}: config.json gives {attention_layers} attention and {mamba_layers} Mamba layers; "
            "a hybrid needs both (check its layer type list)"
        )
    # This process runs on the CPU platform, which turns the hybrid KV-cache manager off;
    # the CUDA engine keeps it on for hybrid models, and plans with it.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    specs = _layer_specs(vllm_config, attention_layers, mamba_layers)
    gpu_kv = int(serve.kv_cache_memory_bytes or gpu_kv_bytes or DEFAULT_GPU_KV_GIB * GIB)
    from hybrid_kv_plugin.models.kv_plan import kv_cache_planner, resolve_block_sizes, resolve_layout

    resolve_layout(vllm_config, FlashAttentionBackend, specs)
    planner = kv_cache_planner()
    groups = planner.get_kv_cache_groups(vllm_config, specs)
    kv_cache_config = planner.get_kv_cache_config_from_groups(vllm_config, groups, gpu_kv)
    cpu = int(serve.cpu_bytes_to_use or cpu_bytes or DEFAULT_CPU_GIB * GIB)
    # SimpleCPU's own sizing of its pool from this GPU plan (the rule differs between wheels).
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    cpu_blocks = SimpleCPUOffloadScheduler._derive_cpu_config(kv_cache_config, cpu).num_blocks
    page_bytes = next(iter(specs.values())).page_size_bytes
    from vllm.v1.kv_cache_interface import MambaSpec

    from hybrid_kv_plugin.registration import current_adapter

    # The engine's own (scheduler block, hash unit) resolution, which also refuses a bad unit.
    _scheduler_block, unit = resolve_block_sizes(current_adapter(), kv_cache_config, vllm_config)
    block = cache_config.block_size
    mamba_block = cache_config.mamba_block_size or block
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            mamba_block = spec.block_size
            break
    return ModelGeometry(
        model=serve.model,
        architecture=model_config.architecture,
        attention_block_size=block,
        mamba_block_size=mamba_block,
        hash_block_size=unit,
        mamba_cache_mode=cache_config.mamba_cache_mode,
        max_model_len=model_config.max_model_len,
        attention_layers=attention_layers,
        mamba_layers=mamba_layers,
        page_bytes=page_bytes,
        block_bytes=gpu_kv // kv_cache_config.num_blocks,
        gpu_blocks=kv_cache_config.num_blocks,
        cpu_blocks=cpu_blocks,
        gpu_kv_bytes=gpu_kv,
        cpu_bytes=cpu,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        max_num_seqs=scheduler_config.max_num_seqs,
        mamba_groups=sum(isinstance(g.kv_cache_spec, MambaSpec) for g in groups),
    )


# Per-layer type spellings (they differ between models and transformers releases). A
# "hybrid" layer (Zamba2) holds a Mamba mixer and an attention block; "conv" is LFM2's
# short convolution, which vLLM caches as Mamba-style state.
_ATTENTION_TYPES = ("attention", "full_attention", "hybrid")
_STATE_TYPES = ("mamba", "linear_attention", "conv", "hybrid")


def _layer_counts(model_config: Any, parallel_config: Any) -> tuple[int, int]:
    """(attention layers, Mamba/linear-attention layers) that hold a KV-cache entry each.

    From the per-layer type list where the config carries one; Kimi-Linear's
    ``linear_attn_config`` lists both kinds; else vLLM's own count, where a model whose every
    layer runs attention and Mamba side by side (Falcon-H1) counts only "hybrid" layers."""
    text = model_config.hf_text_config
    types = getattr(text, "layers_block_type", None) or getattr(text, "layer_types", None)
    if types:
        return sum(t in _ATTENTION_TYPES for t in types), sum(t in _STATE_TYPES for t in types)
    linear = getattr(text, "linear_attn_config", None)
    if isinstance(linear, dict) and "full_attn_layers" in linear and "kda_layers" in linear:
        return len(linear["full_attn_layers"] or ()), len(linear["kda_layers"] or ())
    attention = model_config.get_num_layers_by_block_type(parallel_config, "attention")
    mamba = model_config.get_num_layers_by_block_type(parallel_config, "mamba")
    if attention == mamba == 0:
        parallel = model_config.get_num_layers_by_block_type(parallel_config, "hybrid")
        return parallel, parallel
    return attention, mamba


def _layer_specs(vllm_config: Any, attention_layers: int, mamba_layers: int) -> dict[str, Any]:
    """One KV-cache spec per layer, as the model's layers would report them (no layer is built)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    dtype = model_config.dtype
    if cache_config.cache_dtype != "auto":
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        dtype = STR_DTYPE_TO_TORCH_DTYPE[cache_config.cache_dtype]
    attention_kwargs: dict[str, Any] = {
        "block_size": cache_config.block_size,
        "num_kv_heads": model_config.get_num_kv_heads(parallel_config),
        "head_size": model_config.get_head_size(),
        "dtype": dtype,
    }
    # MLA (Kimi-Linear) caches one latent per token, not K and V: its own spec, as vLLM's alignment sizes it.
    if model_config.use_mla:
        attention = MLAAttentionSpec(**attention_kwargs, cache_dtype_str=cache_config.cache_dtype)
    else:
        attention = FullAttentionSpec(**attention_kwargs)
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    mamba = MambaSpec(
        block_size=(cache_config.mamba_block_size or cache_config.block_size)
        if cache_config.mamba_cache_mode == "align"
        else model_config.max_model_len,
        shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
        dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
        page_size_padded=cache_config.mamba_page_size_padded,
        mamba_cache_mode=cache_config.mamba_cache_mode,
    )
    specs: dict[str, Any] = {f"model.layers.{i}.attn": attention for i in range(attention_layers)}
    specs.update({f"model.layers.{attention_layers + i}.mamba": mamba for i in range(mamba_layers)})
    return specs


def describe(geometry: ModelGeometry) -> str:
    """The report's geometry line for a resolved model."""
    g = geometry
    return (
        f"model {g.architecture} ({g.attention_layers} attention + {g.mamba_layers} Mamba layers), resolved by "
        f"vLLM: FA block {g.attention_block_size} / Mamba block {g.mamba_block_size} {g.mamba_cache_mode} / "
        f"prefix-match unit {g.hash_block_size}; max model len {g.max_model_len}; GPU {g.gpu_blocks} blocks "
        f"({g.gpu_kv_bytes / GIB:.1f} GiB KV), CPU {g.cpu_blocks} blocks ({g.cpu_bytes / GIB:.1f} GiB); "
        f"{g.block_bytes / (1 << 20):.1f} MiB a block"
    )
