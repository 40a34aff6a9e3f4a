"""How a Mooncake trace's hash ids become prompts: the conversation model.

``blocks`` (the literal reading): each hash id stands for one fixed block of tokens
(:class:`~hybrid_kv_plugin.sim.mooncake.BlockTokens`), a prompt is its blocks cut to
``input_length``. Two requests then share exactly their leading equal hash ids.

``continuation`` (the default): the same, except for the next turn of a chat. Request B
*continues* an earlier request A when

* the earlier request B shares the most leading hash ids with is A (the latest such one),
* A's prompt ended in a partial block and B shares all of A's full blocks (at least one),
* and B is longer than A's prompt.

B's prompt is then A's prompt tokens, A's answer (the ``output_length`` tokens the
simulator emits for A: :data:`~hybrid_kv_plugin.sim.engine.SAMPLED_TOKEN` each, the ids A
really generated in the replay) where B's ``input_length`` can hold all of it, then B's own
tokens (taken from B's hash-id blocks at the same positions). The blocks reading would give
B fresh tokens from A's partial block on: every chat would diverge at a 512-token boundary.

Invariant in both models: tokens are a function of the *prefix path* of hash ids (a trie
node), never of the request: a block a continued request defined is the block every later
request sharing that path gets, so equal leading hash ids always mean equal leading tokens.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

from hybrid_kv_plugin.sim.engine import SAMPLED_TOKEN

# Token ids are below 32,000 (sim/mooncake.py): two bytes a token keep the full public
# conversation trace's 145 M prompt tokens at 290 MB.
TOKEN_TYPECODE = "H"
CONVERSATION_MODELS = ("continuation", "blocks")
DEFAULT_CONVERSATION_MODEL = "continuation"


@dataclass
class ConversationStats:
    """What the model changed: requests continued, and answer tokens put into their prompts."""

    model: str
    continued_requests: int = 0
    answer_tokens: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "continued_requests": self.continued_requests, "answer_tokens": self.answer_tokens}


class PromptBuilder:
    """Prompts of a Mooncake trace in file order, under one conversation model.

    ``blocks(hash_id)`` gives a hash id's own block (an ``array(TOKEN_TYPECODE)`` of ``block_tokens``).
    """

    def __init__(self, blocks: object, block_tokens: int, model: str = DEFAULT_CONVERSATION_MODEL) -> None:
        if model not in CONVERSATION_MODELS:
            raise ValueError(f"conversation model {model!r} (allowed: {', '.join(CONVERSATION_MODELS)})")
        self.blocks = blocks
        self.block_tokens = block_tokens
        self.stats = ConversationStats(model)
        # Trie of hash-id paths: (parent node, hash id) -> node; node 0 is the root.
        self._children: dict[tuple[int, int], int] = {}
        self._latest: list[int] = [-1]  # per node: the last request whose path passes it
        # Per node defined by a continued request: its tokens (a partial block may be shorter).
        self._content: dict[int, array.array] = {}
        # Per request (file order): prompt tokens and output length, for later continuations.
        self._prompts: list[array.array] = []
        self._outputs: list[int] = []

    def add(self, hash_ids: list[int], input_length: int, output_length: int) -> array.array:
        """The next request's prompt (file order)."""
        nodes, shared, latest = self._walk(hash_ids)
        bt = self.block_tokens
        prompt = None
        if self.stats.model == "continuation" and latest >= 0:
            earlier, earlier_out = self._prompts[latest], self._outputs[latest]
            full = len(earlier) // bt
            if len(earlier) % bt and full >= 1 and shared == full and input_length > len(earlier):
                prompt = array.array(TOKEN_TYPECODE, earlier)
                if input_length >= len(earlier) + earlier_out:
                    prompt.extend([SAMPLED_TOKEN] * earlier_out)
                    self.stats.answer_tokens += earlier_out
                for j in range(len(prompt) // bt, len(hash_ids)):  # own tokens, from B's blocks
                    start = max(len(prompt), j * bt)
                    end = min((j + 1) * bt, input_length)
                    if end > start:
                        prompt.extend(self.blocks(hash_ids[j])[start - j * bt : end - j * bt])
                self.stats.continued_requests += 1
                for j in range(shared, len(nodes)):  # the blocks this request defines
                    self._content[nodes[j]] = prompt[j * bt : (j + 1) * bt]
        if prompt is None:
            prompt = array.array(TOKEN_TYPECODE)
            for j, node in enumerate(nodes):
                prompt.extend(self._block(node, hash_ids[j], min(bt, input_length - j * bt)))
        self._prompts.append(prompt)
        self._outputs.append(output_length)
        return prompt

    def _walk(self, hash_ids: list[int]) -> tuple[list[int], int, int]:
        """This request's node per block (made where new), how many it shares with earlier
        requests, and the latest earlier request on the deepest shared node (-1: none)."""
        request = len(self._prompts)
        nodes: list[int] = []
        shared, latest = 0, -1
        node = 0
        for hash_id in hash_ids:
            child = self._children.get((node, hash_id))
            if child is None:
                child = len(self._latest)
                self._children[(node, hash_id)] = child
                self._latest.append(request)
            else:
                shared += 1
                latest = self._latest[child]
                self._latest[child] = request
            nodes.append(child)
            node = child
        return nodes, shared, latest

    def _block(self, node: int, hash_id: int, length: int) -> array.array:
        content = self._content.get(node)
        if content is None:
            return self.blocks(hash_id)[:length]
        if len(content) < length:  # a partial block seen whole: it goes on as its id's block
            content.extend(self.blocks(hash_id)[len(content) : length])
        return content[:length]
