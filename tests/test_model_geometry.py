"""Geometry of real hybrid models, resolved by the installed wheel's own config code.

The shipped configs (``sim/data/<model>/config.json``, no weights) carry the public model
cards' numbers. The expected block sizes are re-derived below from those numbers with the
rule vLLM applies (the attention page of a block must hold one padded Mamba state; the block
is a multiple of the kernel's 16-token alignment), so a wrong config or a changed rule fails.
"""

from __future__ import annotations

import pytest

from hybrid_kv_plugin.sim.geometry import data_dir
from hybrid_kv_plugin.sim.model_geometry import GIB, GeometryError, ServeLine, parse_serve_line, resolve

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
