"""Drive the installed wheel's real NIXL scheduler classes for one P/D request, without GPUs or a model.

Used by the NIXL tests (test-only: it is not part of the wheel): it builds a
prefill (P) and a decode (D) scheduler of vLLM's own ``NixlPullConnectorScheduler``
or ``NixlPushConnectorScheduler`` over a hand-made hybrid ``KVCacheConfig``
(full attention, sliding window, Mamba), hands them block tables, and reads
back exactly what each side puts on the wire - through vLLM's own
``request_finished`` / ``update_state_after_alloc`` / ``build_connector_meta``.
The scheduler side needs neither the ``nixl`` library nor a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_kv_plugin.sim.geometry import HybridGeometry, build_vllm_config
from hybrid_kv_plugin.sim.wheel import make_kv_cache_tensor

# Group order of the hand-made config, and its geometry.
FULL_ATTENTION, SLIDING_WINDOW, MAMBA = 0, 1, 2
BLOCK_TOKENS = 16
WINDOW_TOKENS = 32  # the NIXL scheduler keeps cdiv(32, 16) + 1 = 3 tail blocks
MAMBA_BLOCK_TOKENS = 64
NUM_BLOCKS = 128
PROMPT_TOKENS = 255


def mamba_cache_modes() -> tuple[str, ...]:
    """The Mamba cache modes the installed wheel accepts (``all`` is gone from 0.32 on)."""
    import typing

    from vllm.config.cache import MambaCacheMode

    return typing.get_args(MambaCacheMode)


def has_mamba_cache_mode(mode: str) -> bool:
    """Whether the installed wheel takes ``mode``. Where it does not (``all`` from 0.32 on), vLLM's
    own ``CacheConfig`` refuses it at start-up naming the modes it takes (asserted): the wheel-aware
    outcome of a test written for that mode, which then has nothing more to run."""
    import re

    import pytest
    from vllm.config import CacheConfig

    accepted = mamba_cache_modes()
    if mode in accepted:
        return True
    quoted = [f"'{m}'" for m in accepted]
    listed = ", ".join(quoted[:-1]) + " or " + quoted[-1]  # pydantic's wording of a literal
    with pytest.raises(ValueError, match=re.escape(f"mamba_cache_mode\n  Input should be {listed}")):
        CacheConfig(mamba_cache_mode=mode)
    return False


def nixl_vllm_config(adapter: Any, mamba_cache_mode: str) -> Any:
    """A ``VllmConfig`` selecting NixlConnector, as a GPU engine serving a hybrid model has it.

    Two fields are set the way such an engine ends up with them, because the
    CPU stand-in cannot get there by itself:

    * vLLM turns the hybrid KV-cache manager off on the CPU platform; on a GPU
      it stays on for NIXL (which supports HMA), and the NIXL schedulers clip
      only when it is on;
    * the tiny Qwen3-Next stand-in does not support Mamba ``all`` mode, so
      vLLM normalises ``all`` to ``align`` for it; models that do (Mamba2,
      Jamba, NemotronH, ...) keep ``all``, and the connector reads only this
      field. ``none`` is what an engine without prefix caching runs.
    """
    geometry = HybridGeometry(mamba_cache_mode=mamba_cache_mode, enable_prefix_caching=mamba_cache_mode != "none")
    config = build_vllm_config(geometry, adapter, kv_connector="NixlConnector")
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.cache_config.mamba_cache_mode = mamba_cache_mode
    return config


def hybrid_kv_cache_config(adapter: Any, mamba_cache_mode: str, scratch_slots: int) -> Any:
    """Full attention + sliding window + Mamba (``scratch_slots`` speculative blocks), one shared pool."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    geometry = HybridGeometry(mamba_cache_mode=mamba_cache_mode)
    attention = dict(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=16, dtype=torch.float16)
    specs = [
        FullAttentionSpec(**attention),
        SlidingWindowSpec(**attention, sliding_window=WINDOW_TOKENS),
        MambaSpec(
            block_size=MAMBA_BLOCK_TOKENS,
            shapes=geometry.mamba_state_shapes(),
            dtypes=(torch.float16, torch.float16),
            mamba_cache_mode=mamba_cache_mode,
            num_speculative_blocks=scratch_slots,
        ),
    ]
    layers = ["layers.0.attn", "layers.1.attn", "layers.2.mamba"]
    page = specs[0].page_size_bytes
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[make_kv_cache_tensor(adapter, page * NUM_BLOCKS, layers, page)],
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in zip(layers, specs)],
    )


def _request(request_id: str, kv_transfer_params: dict[str, Any]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, PROMPT_TOKENS + 1)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    request.kv_transfer_params = kv_transfer_params
    return request


def kv_cache_blocks(table: Sequence[Sequence[int | None]]) -> Any:
    """``KVCacheBlocks`` of fresh (unhashed) blocks; ``None`` stands for the pool's null block."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    def block(block_id: int | None) -> Any:
        return KVCacheBlock(0, is_null=True) if block_id is None else KVCacheBlock(block_id)

    return KVCacheBlocks(tuple([block(b) for b in group] for group in table))


def as_lists(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(group) for group in block_ids]


@dataclass
class NixlPair:
    """One prefill and one decode scheduler of the same kind ("pull" or "push") and geometry."""

    adapter: Any
    kind: str = "pull"
    mamba_cache_mode: str = "align"
    scratch_slots: int = 2
    vllm_config: Any = field(init=False)
    kv_cache_config: Any = field(init=False)
    prefill: Any = field(init=False)
    decode: Any = field(init=False)

    def __post_init__(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
            NixlPullConnectorScheduler,
            NixlPushConnectorScheduler,
        )

        cls = {"pull": NixlPullConnectorScheduler, "push": NixlPushConnectorScheduler}[self.kind]
        self.vllm_config = nixl_vllm_config(self.adapter, self.mamba_cache_mode)
        self.kv_cache_config = hybrid_kv_cache_config(self.adapter, self.mamba_cache_mode, self.scratch_slots)
        self.prefill = cls(self.vllm_config, "prefill-engine", self.kv_cache_config)
        self.decode = cls(self.vllm_config, "decode-engine", self.kv_cache_config)

    # ------------------------------------------------------------------ P side
    def prefill_finishes(self, table: Sequence[list[int]], request_id: str = "req-p") -> dict[str, Any]:
        """P's ``request_finished``: the kv_transfer_params it returns for D (``remote_block_ids`` etc.)."""
        from vllm.v1.request import RequestStatus

        request = _request(request_id, {"do_remote_decode": True})
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay_free, params = self.prefill.request_finished(request, tuple(list(g) for g in table))
        assert delay_free and params is not None
        return params

    def prefill_sends(self, table: Sequence[list[int]]) -> list[list[int]]:
        """The prefill-side exchange list: what P announces (pull) or pushes from (push)."""
        params = self.prefill_finishes(table)
        sent = as_lists(params["remote_block_ids"])
        if self.kind == "push":
            # The P worker matches D's registration against this copy; it must be the same list.
            meta = self.prefill.build_connector_meta(_empty_scheduler_output())
            assert as_lists(meta.push_finished_blocks["req-p"]) == sent
        return sent

    # ------------------------------------------------------------------ D side
    def decode_receives(self, table: Sequence[Sequence[int | None]], request_id: str = "req-d") -> list[list[int]]:
        """The decode-side exchange list: what D's worker gets as its local ids (and D registers in push)."""
        params = {
            "do_remote_prefill": True,
            "remote_block_ids": [[] for _ in table],
            "remote_engine_id": "prefill-engine",
            "remote_request_id": "req-p",
            "remote_host": "prefill.invalid",
            "remote_port": 1,
            "tp_size": 1,
        }
        request = _request(request_id, params)
        self.decode.update_state_after_alloc(request, kv_cache_blocks(table), PROMPT_TOKENS - 1)
        meta = self.decode.build_connector_meta(_empty_scheduler_output())
        received = as_lists(meta.reqs_to_recv[request_id].local_block_ids)
        if self.kind == "push":
            assert as_lists(meta.push_registrations[request_id]["local_block_ids"]) == received
        return received

    # ------------------------------------------------------------------ host-buffer save path (P side)
    def prefill_saves(self, step_ids: Sequence[list[int]], request_id: str = "req-s") -> list[list[int]]:
        """The ids P's per-step host-buffer save hands its workers for one scheduled step.

        The CPU platform never uses a host buffer; the scheduler is told to, as
        on a GPU with ``kv_buffer_device="cpu"``.
        """
        from vllm.v1.core.sched.output import NewRequestData

        self.prefill.use_host_buffer = True
        request = _request(request_id, {"do_remote_decode": True})
        self.prefill.update_state_after_alloc(request, kv_cache_blocks(step_ids), 0)
        output = _empty_scheduler_output()
        output.scheduled_new_reqs.append(NewRequestData.from_request(request, tuple(list(g) for g in step_ids)))
        output.num_scheduled_tokens[request_id] = PROMPT_TOKENS
        meta = self.prefill.build_connector_meta(output)
        return as_lists(meta.reqs_to_save[request_id].local_block_ids)


def _empty_scheduler_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def decode_worker(adapter: Any, pair: NixlPair) -> Any:
    """vLLM's ``NixlPullConnectorWorker`` for ``pair``'s decode engine, holding only what pairing reads.

    A real worker's ``__init__`` needs NIXL agents, a tensor-parallel group and
    the model's attention backends; ``_apply_prefix_caching`` reads only the
    model's group layout, which is set here from the same configs.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker
    from vllm.v1.kv_cache_interface import MambaSpec

    worker = NixlPullConnectorWorker.__new__(NixlPullConnectorWorker)
    groups = pair.kv_cache_config.kv_cache_groups
    worker.vllm_config = pair.vllm_config
    worker.kv_cache_config = pair.kv_cache_config
    worker._has_mamba = any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
    worker._group_spec_types = tuple(type(g.kv_cache_spec) for g in groups)
    worker._physical_blocks_per_logical_kv_block = 1
    return worker


def worker_pairs(
    adapter: Any, worker: Any, decode_ids: Sequence[list[int]], prefill_ids: Sequence[list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """The decode worker's pairing, called the way the installed wheel's readers call it."""
    ratios = (1,) * adapter.nixl_pairing_ratio_args
    decode, prefill = worker._apply_prefix_caching(as_lists(decode_ids), as_lists(prefill_ids), *ratios)
    return as_lists(decode), as_lists(prefill)
