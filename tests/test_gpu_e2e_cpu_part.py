"""The CPU-safe part of examples/gpu_e2e.py: its model config and command lines are valid here."""

from __future__ import annotations

import importlib.util
import pathlib

from hybrid_kv_plugin.sim.geometry import MODEL_DIR, data_dir

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "gpu_e2e.py"


def _example():
    spec = importlib.util.spec_from_file_location("gpu_e2e", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_model_config_loads_through_vllm():
    from vllm.config import ModelConfig

    config = ModelConfig(model=data_dir(MODEL_DIR), skip_tokenizer_init=True, max_model_len=4096)
    assert config.architectures == ["Qwen3NextForCausalLM"]
    assert config.is_hybrid is True
    assert config.max_model_len == 4096


def test_serve_command_lines_pass_doctor(adapter):
    example = _example()
    for connector in ("SimpleCPUOffloadConnector", "HybridSimpleCPUConnector"):
        command = example.serve_command(connector)
        assert command[:3] == ["vllm", "serve", data_dir(MODEL_DIR)]
        assert example.validate(command) == []
