"""Smoke-check a pinned vLLM venv: imports + offline config builds.

Run with the venv's python, HF_HUB_OFFLINE=1 and VLLM_CACHE_ROOT=<tmp dir>:

    HF_HUB_OFFLINE=1 VLLM_CACHE_ROOT=$(mktemp -d) .venvs/vllm-0.29.0/bin/python \
        scripts/pins/verify_env.py [path/to/tiny-qwen3-next-config.json]

Prints one line per check and exits non-zero if a required check fails.
The constructor arguments used here are the minimal ones that build on every
wheel 0.26.0 ... 0.33.0 (see scripts/pins/README.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_QWEN_CONFIG = Path("/work/shared/reference/tiny-qwen3-next-config.json")

# Hand-written tiny Llama config used as an EAGLE draft model (no weights).
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}

REQUIRED_IMPORTS = [
    ("vllm.v1.core.sched.scheduler", "Scheduler"),
    ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
    ("vllm.v1.simple_kv_offload.manager", "SimpleCPUOffloadScheduler"),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        "SimpleCPUOffloadConnector",
    ),
    ("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory"),
    ("vllm.plugins", "load_general_plugins"),
    ("vllm.config", "VllmConfig"),
    ("vllm.config", "ModelConfig"),
    ("vllm.config", "CacheConfig"),
    ("vllm.config", "SchedulerConfig"),
    ("vllm.config", "DeviceConfig"),
    ("vllm.config", "SpeculativeConfig"),
    ("vllm.engine.arg_utils", "EngineArgs"),
    ("vllm.v1.engine.core", "EngineCore"),
]
NIXL_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
NIXL_SCHED_MODULES = ["", ".metadata", ".base_scheduler", ".pull_scheduler",
                      ".push_scheduler", ".scheduler", ".connector"]
NIXL_WORKER_MODULES = [".base_worker", ".pull_worker", ".push_worker", ".worker"]
OPTIONAL_IMPORTS = [("vllm.entrypoints.cli.main", "main")]

failures: list[str] = []
queried_dists: set[str] = set()


def _trace_metadata_queries() -> None:
    """Record distribution names looked up via importlib.metadata."""
    import importlib.metadata as md

    for fname in ("version", "distribution", "metadata", "requires", "files"):
        orig = getattr(md, fname)

        def wrapper(name, *a, __orig=orig, **k):
            queried_dists.add(str(name))
            return __orig(name, *a, **k)

        setattr(md, fname, wrapper)


def _print_used_dists() -> None:
    import importlib.metadata as md

    mapping = md.packages_distributions()
    used: set[str] = set()
    for mod in list(sys.modules):
        top = mod.split(".")[0]
        for dist in mapping.get(top, []):
            used.add(dist)
    installed = {d.metadata["Name"] for d in md.distributions()}
    norm = lambda n: n.lower().replace("_", "-").replace(".", "-")  # noqa: E731
    used_n = {norm(d) for d in used}
    queried_n = {norm(d) for d in queried_dists}
    print("TRACE imported: " + " ".join(sorted(used_n)))
    print("TRACE metadata-queried: " + " ".join(sorted(queried_n)))
    print("TRACE unused: " + " ".join(sorted(
        norm(d) for d in installed if norm(d) not in used_n | queried_n)))


def report(name: str, ok: bool, detail: str = "", required: bool = True) -> None:
    tag = "ok  " if ok else ("FAIL" if required else "warn")
    print(f"{tag} {name}{(': ' + detail) if detail else ''}", flush=True)
    if not ok and required:
        failures.append(name)


def try_import(mod: str, attr: str | None, required: bool = True) -> None:
    t0 = time.perf_counter()
    try:
        m = importlib.import_module(mod)
        if attr:
            getattr(m, attr)
        report(f"import {mod}{'.' + attr if attr else ''}", True,
               f"{time.perf_counter() - t0:.1f}s", required)
    except Exception as e:  # noqa: BLE001
        report(f"import {mod}{'.' + attr if attr else ''}", False,
               f"{type(e).__name__}: {e}", required)


def main() -> int:
    trace = os.environ.get("HKV_TRACE_DISTS") == "1"
    if trace:
        _trace_metadata_queries()
    qwen_cfg = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_QWEN_CONFIG
    print(f"vllm {importlib.metadata.version('vllm')}, "
          f"torch {importlib.metadata.version('torch')}, "
          f"pydantic {importlib.metadata.version('pydantic')}", flush=True)
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        print("warn HF_HUB_OFFLINE is not 1", flush=True)

    for mod, attr in REQUIRED_IMPORTS:
        try_import(mod, attr)
    for suffix in NIXL_SCHED_MODULES:
        try_import(NIXL_PKG + suffix, None)
    try:
        import nixl  # noqa: F401
        print("info nixl library is installed", flush=True)
    except ImportError:
        print("info nixl library is NOT installed (expected)", flush=True)
    for suffix in NIXL_WORKER_MODULES:
        try_import(NIXL_PKG + suffix, None, required=False)
    for mod, attr in OPTIONAL_IMPORTS:
        try_import(mod, attr, required=False)

    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)

    tmp = Path(tempfile.mkdtemp(prefix="hybrid-kv-verify-"))
    atexit.register(shutil.rmtree, tmp, True)  # nothing left behind
    model_dir = tmp / "tiny-qwen3-next"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(qwen_cfg.read_text())
    draft_dir = tmp / "tiny-llama-eagle"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))

    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    cache_kwargs = dict(block_size=16, enable_prefix_caching=True)
    if "mamba_cache_mode" in cache_fields:
        cache_kwargs["mamba_cache_mode"] = "align"

    def model_config() -> ModelConfig:
        return ModelConfig(model=str(model_dir), skip_tokenizer_init=True)

    def scheduler_config(mc: ModelConfig) -> SchedulerConfig:
        # max_model_len / is_encoder_decoder are required InitVars (0.26-0.33).
        return SchedulerConfig(max_model_len=mc.max_model_len,
                               is_encoder_decoder=mc.is_encoder_decoder)

    def build(name, fn, required=True):
        t0 = time.perf_counter()
        try:
            out = fn()
            report(name, True, f"{time.perf_counter() - t0:.1f}s", required)
            return out
        except Exception as e:  # noqa: BLE001
            if required:
                traceback.print_exc()
            report(name, False, f"{type(e).__name__}: {str(e)[:300]}", required)
            return None

    mc = build("ModelConfig(tiny qwen3-next)", model_config)
    if mc is None:
        print(f"RESULT FAIL {', '.join(failures)}", flush=True)
        return 1
    print(f"info architectures={mc.architectures} is_hybrid="
          f"{getattr(mc, 'is_hybrid', '?')} max_model_len={mc.max_model_len}",
          flush=True)

    def vllm_config(spec=None, with_sched=True):
        kw = dict(
            model_config=mc,
            device_config=DeviceConfig("cpu"),
            cache_config=CacheConfig(**cache_kwargs),
        )
        if with_sched:
            kw["scheduler_config"] = scheduler_config(mc)
        if spec is not None:
            kw["speculative_config"] = spec
        return VllmConfig(**kw)

    vc = build(f"VllmConfig(CacheConfig({cache_kwargs}))", vllm_config)
    if vc is not None:
        print(f"info cache_config.mamba_cache_mode="
              f"{getattr(vc.cache_config, 'mamba_cache_mode', None)} "
              f"block_size={vc.cache_config.block_size} "
              f"mamba_block_size={getattr(vc.cache_config, 'mamba_block_size', None)}",
              flush=True)

    build("info-only: VllmConfig without scheduler_config",
          lambda: vllm_config(with_sched=False), required=False)

    def spec_config():
        return SpeculativeConfig(
            method="eagle",
            num_speculative_tokens=1,
            model=str(draft_dir),
            target_model_config=mc,
            target_parallel_config=ParallelConfig(),
        )

    sc = build("SpeculativeConfig(eagle, tiny llama draft)", spec_config)
    if sc is not None:
        vcs = build("VllmConfig(..., speculative_config=eagle)",
                    lambda: vllm_config(sc))
        if vcs is not None:
            print(f"info spec method={vcs.speculative_config.method} "
                  f"draft arch={vcs.speculative_config.draft_model_config.architectures}",
                  flush=True)

    if trace:
        _print_used_dists()
    print(f"RESULT {'FAIL ' + ', '.join(failures) if failures else 'OK'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
