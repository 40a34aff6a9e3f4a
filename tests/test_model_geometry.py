"""Geometry of real hybrid models, resolved by the installed wheel's own config code.

The shipped configs (``sim/data/<model>/config.json``, no weights) carry the public model
cards' numbers. The expected block sizes are re-derived below from those numbers with the
rule vLLM applies (the attention page of a block must hold one padded Mamba state; the block
is a multiple of the kernel's 16-token alignment), so a wrong config or a changed rule fails.
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.models.geometry import GIB, GeometryError, ServeLine, parse_serve_line, resolve
from hybrid_kv_plugin.sim.geometry import data_dir

QWEN3_NEXT = data_dir("qwen3-next-80b-a3b-instruct")
NEMOTRON_H = data_dir("nemotron-nano-9b-v2")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aligned_block(mamba_state_bytes: int, attention_bytes_per_token: int, alignment: int = 16) -> int:
    return alignment * _cdiv(mamba_state_bytes, alignment * attention_bytes_per_token)


# Qwen3-Next-80B-A3B: K+V x 2 KV heads x head_dim 256 x bf16 per attention token; a Gated
# DeltaNet state is the conv state (kernel 4 - 1) x (2 x 16 x 128 + 32 x 128) plus the
# recurrent state 32 heads x 128 x 128, all bf16.
QWEN_ATTENTION_TOKEN = 2 * 2 * 256 * 2
QWEN_STATE = (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2
# Nemotron-Nano-9B-v2: K+V x 8 KV heads x 128 x bf16; a Mamba2 state is the conv state
# (4 - 1) x (128 x 80 + 2 x 8 x 128) in bf16 plus the SSM state 128 x 80 x 128 in fp32
# (vLLM keeps Nemotron-H's SSM state in float32).
NEMOTRON_ATTENTION_TOKEN = 2 * 8 * 128 * 2
NEMOTRON_STATE = 3 * (128 * 80 + 2 * 8 * 128) * 2 + 128 * 80 * 128 * 4


@pytest.fixture(scope="module")
def qwen():
    return resolve(ServeLine(model=QWEN3_NEXT))


def test_qwen3_next_geometry(qwen):
    block = _aligned_block(QWEN_STATE, QWEN_ATTENTION_TOKEN)
    assert block == 544
    assert (qwen.attention_block_size, qwen.mamba_block_size, qwen.hash_block_size) == (544, 544, 544)
    assert qwen.mamba_cache_mode == "align"
    assert qwen.max_model_len == 262144
    assert (qwen.attention_layers, qwen.mamba_layers) == (12, 36)
    assert qwen.page_bytes == 544 * QWEN_ATTENTION_TOKEN == 1_114_112
    # 48 layers in 4 groups of 12 share 12 tensors: a block costs 12 pages.
    assert qwen.gpu_blocks == 40 * GIB // (12 * qwen.page_bytes) == 3212
    assert qwen.cpu_blocks == 12850  # SimpleCPU: 3212 blocks x 160 GiB / 40 GiB (floor, per the wheel's rule)
    assert (qwen.max_num_batched_tokens, qwen.max_num_seqs) == (8192, 256)


def test_nemotron_h_geometry():
    geometry = resolve(ServeLine(model=NEMOTRON_H))
    block = _aligned_block(NEMOTRON_STATE, NEMOTRON_ATTENTION_TOKEN)
    assert block == 1312
    assert (geometry.attention_block_size, geometry.mamba_block_size, geometry.hash_block_size) == (1312, 1312, 1312)
    assert geometry.max_model_len == 131072
    assert (geometry.attention_layers, geometry.mamba_layers) == (4, 27)
    assert geometry.page_bytes == 1312 * NEMOTRON_ATTENTION_TOKEN
    assert geometry.gpu_blocks == 1998
    assert geometry.cpu_blocks == 7992


def test_serve_line_flags_reach_the_geometry():
    serve = parse_serve_line(
        f"vllm serve {QWEN3_NEXT} --prefix-match-unit 16 --max-model-len 131072 --kv-cache-memory-bytes 20G "
        """--kv-transfer-config '{"kv_connector":"SimpleCPUOffloadConnector","kv_role":"kv_both",'"""
        """'"kv_connector_extra_config":{"cpu_bytes_to_use":42949672960}}'"""
    )
    geometry = resolve(serve)
    assert geometry.hash_block_size == 16
    assert geometry.attention_block_size == 544
    assert geometry.max_model_len == 131072
    assert geometry.gpu_blocks == 20 * GIB // (12 * geometry.page_bytes) == 1606
    assert geometry.cpu_blocks == 3212


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # The wording after the reason differs between wheels; the reason is vLLM's own.
        ("--prefix-match-unit 7", "vLLM refuses this geometry: Invalid prefix_match_unit=7; "),
        ("--max-model-len 300000", "vLLM refuses this geometry: User-specified max_model_len (300000) is greater than "
         "the derived max_model_len (max_position_embeddings=262144.0"),
    ],
)
def test_refused_geometry_is_vllms_message_on_one_line(flags, message):
    with pytest.raises(GeometryError) as err:
        resolve(parse_serve_line(f"{QWEN3_NEXT} {flags}"))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(GeometryError) as err:
        resolve(ServeLine(model=str(tmp_path)))
    assert str(err.value) == f"{tmp_path}: no config.json there (a local model directory is needed)"


# ---------------------------------------------------------------------------- every hybrid architecture
# (config dir, architecture, attention block, Mamba block, unit, attention layers, Mamba layers, max model len).
# Each wheel 0.26-0.33 resolves these the same, except Kimi-Linear's block (its KDA state changed in 0.27).
ARCHITECTURES = [
    ("qwen3.5-27b", "Qwen3_5ForCausalLM", 400, 400, 400, 16, 48, 262144),
    ("qwen3.5-35b-a3b", "Qwen3_5MoeForCausalLM", 544, 544, 544, 10, 30, 262144),
    ("qwen3-next-80b-a3b-instruct", "Qwen3NextForCausalLM", 544, 544, 544, 12, 36, 262144),
    ("nemotron-nano-9b-v2", "NemotronHForCausalLM", 1312, 1312, 1312, 4, 27, 131072),
    ("granite-4.0-h-small", "GraniteMoeHybridForCausalLM", 528, 528, 528, 4, 36, 131072),
    ("jamba-mini-1.5", "JambaForCausalLM", 80, 80, 80, 4, 28, 262144),
    # Every Falcon-H1 layer runs attention and Mamba side by side.
    ("falcon-h1-7b-instruct", "FalconH1ForCausalLM", 3120, 3120, 3120, 44, 44, 262144),
    ("kimi-linear-48b-a3b-instruct", "KimiLinearForCausalLM", None, None, None, 7, 20, 1048576),
    # Zamba2's 8 "hybrid" layers hold a Mamba mixer and a shared attention block each.
    ("zamba2-2.7b-instruct", "Zamba2ForCausalLM", 48, 48, 48, 8, 54, 4096),
    ("lfm2-1.2b", "Lfm2ForCausalLM", 16, 16, 16, 6, 10, 128000),
]


def _kimi_block(adapter) -> int:
    return 1888 if adapter.version == "0.26.0" else 1920


@pytest.mark.parametrize("row", ARCHITECTURES, ids=[r[0] for r in ARCHITECTURES])
def test_every_hybrid_architecture_resolves(row, adapter):
    name, arch, attention, mamba, unit, attention_layers, mamba_layers, max_len = row
    if attention is None:
        attention = mamba = unit = _kimi_block(adapter)
    geometry = resolve(ServeLine(model=data_dir(name)))
    assert geometry.architecture == arch
    assert (geometry.attention_block_size, geometry.mamba_block_size, geometry.hash_block_size) == (attention, mamba, unit)
    assert (geometry.attention_layers, geometry.mamba_layers) == (attention_layers, mamba_layers)
    assert geometry.max_model_len == max_len
    assert geometry.mamba_cache_mode == "align"


def test_qwen3_5_blocks_follow_vllms_rule():
    # Qwen3.5-27B: K+V x 4 KV heads x 256 x bf16; Gated DeltaNet state (4 - 1) x (2 x 16 x 128 + 48 x 128)
    # plus 48 x 128 x 128, bf16. Qwen3.5-35B-A3B: 2 KV heads; 32 value heads.
    assert _aligned_block(3 * (2 * 16 * 128 + 48 * 128) * 2 + 48 * 128 * 128 * 2, 2 * 4 * 256 * 2) == 400
    assert _aligned_block(3 * (2 * 16 * 128 + 32 * 128) * 2 + 32 * 128 * 128 * 2, 2 * 2 * 256 * 2) == 544


@pytest.mark.parametrize("name", ["bamba-9b", "minimax-text-01"])
def test_architecture_vllm_no_longer_serves(name, adapter):
    arch = {"bamba-9b": "BambaForCausalLM", "minimax-text-01": "MiniMaxText01ForCausalLM"}[name]
    with pytest.raises(GeometryError) as err:
        resolve(ServeLine(model=data_dir(name)))
    assert str(err.value) == (
        f"vLLM refuses this geometry: config.json architectures {arch}: vLLM {adapter.version} no longer serves it "
        "(removed in 0.23.0); serve it with vLLM < 0.23.0, where this plugin does not run"
    )


def _edited_config(tmp_path, name, edit):
    import json

    with open(f"{data_dir(name)}/config.json", encoding="utf-8") as f:
        config = json.load(f)
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_missing_config_field_is_named(tmp_path):
    model = _edited_config(tmp_path, "lfm2-1.2b", lambda c: c.pop("conv_dim"))
    with pytest.raises(GeometryError) as err:
        resolve(ServeLine(model=model))
    assert str(err.value) == (
        "vLLM refuses this geometry: config.json has no field 'conv_dim', which vLLM's Lfm2ForCausalLM code reads; "
        "copy it from the model's published config.json"
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: c.pop("linear_attn_config"),
            "config.json field 'linear_attn_config' is missing; vLLM's KimiLinearForCausalLM code needs it as an "
            "object with full_attn_layers, kda_layers, head_dim, num_heads, short_conv_kernel_size: copy it from "
            "the published config.json",
        ),
        (
            lambda c: c["linear_attn_config"].pop("full_attn_layers"),
            "config.json field 'linear_attn_config' lacks full_attn_layers, which vLLM's KimiLinearForCausalLM code "
            "reads: copy it from the published config.json",
        ),
    ],
)
def test_kimi_linear_without_its_layer_map(tmp_path, edit, message):
    model = _edited_config(tmp_path, "kimi-linear-48b-a3b-instruct", edit)
    with pytest.raises(GeometryError) as err:
        resolve(ServeLine(model=model))
    assert str(err.value) == "vLLM refuses this geometry: " + message


def test_a_unit_that_does_not_divide_the_resolved_block_is_explained():
    with pytest.raises(GeometryError) as err:
        resolve(parse_serve_line(f"{QWEN3_NEXT} --prefix-match-unit 64"))
    assert str(err.value).startswith("vLLM refuses this geometry: Invalid prefix_match_unit=64; ")
    assert str(err.value).endswith(
        " -- in plain words: --prefix-match-unit 64 must divide the 544-token attention block and the 544-token "
        "Mamba block vLLM resolves for Qwen3NextForCausalLM; units that do: 16, 32, 272, 544"
    )


def test_finest_unit_and_its_cost(qwen):
    from hybrid_kv_plugin.models.unit_advice import finer_unit

    advice = finer_unit(ServeLine(model=QWEN3_NEXT), qwen)
    assert (advice.unit, advice.block, advice.hashes_per_block) == (16, 544, 34)
    assert advice.mamba_state_bytes == 36 * 1_114_112  # one padded page per Mamba layer
    # Already on the finest step of the kernel grid: nothing finer to name.
    lfm2 = resolve(ServeLine(model=data_dir("lfm2-1.2b")))
    assert finer_unit(ServeLine(model=data_dir("lfm2-1.2b")), lfm2) is None


def test_inspection_leaves_nothing_behind():
    import importlib.util
    import sys

    from vllm.model_executor.models import registry

    from hybrid_kv_plugin.models.inspection import _AbsentFinder

    resolve(ServeLine(model=data_dir("qwen3.5-27b")))
    assert registry._run_in_subprocess.__module__ == registry.__name__
    assert not any(isinstance(finder, _AbsentFinder) for finder in sys.meta_path)
    if importlib.util.find_spec("torchvision") is None:  # the lean pins: the placeholder modules are gone
        assert not [name for name in sys.modules if name.split(".")[0] == "torchvision"]
