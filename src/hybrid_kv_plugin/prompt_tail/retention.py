"""The positions sparse prefix-cache retention must keep for the prompt-tail policy.

Under ``prefix_cache_retention_interval`` 0 (vLLM's default on 0.30+) the Mamba
manager keeps a full block's state only where its ``replay_boundaries`` say: the
wheel passes ``N - 1`` alone, so a state ending exactly on a Mamba block at N (the
``continuation`` position of ``both`` when N is on the block grid) is never hashed,
cached or handed to a connector. Adding the positions the policy keeps fixes that;
sub-block positions are kept through partial keys (:mod:`.state`) and need nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid_kv_plugin.prompt_tail.policy import PromptTailPolicy


def retained_boundaries(policy: PromptTailPolicy, num_prompt_tokens: int, boundaries: Sequence[int]) -> tuple[int, ...]:
    """``boundaries`` plus every position ``policy`` keeps for a prompt of ``num_prompt_tokens``."""
    if not policy.active:
        return tuple(boundaries)
    return tuple(sorted({*boundaries, *policy.kept(num_prompt_tokens)}))
