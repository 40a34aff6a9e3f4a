"""Where the prompt-tail Mamba state is kept (``prompt_tail_checkpoint``: native, replay, both).

A prompt computed in ``align`` mode leaves one reusable Mamba state near its end.
vLLM 0.29-0.31 keep it at the prompt's last hash boundary (a continuation of the
prompt reuses everything, an exact replay - which must recompute the last token -
reuses nothing); 0.32+ keep it at the last hash boundary <= N-1 (exact replays
hit, continuations lose up to one unit). ``both`` keeps the two states.

Pieces:

* :mod:`.policy` - the positions of each value (:class:`PromptTailPolicy`);
* :mod:`.binding` - one policy per scheduler, handed to its Mamba managers;
* :mod:`.state` - keeping a partial Mamba state at an added position;
* :mod:`.retention` - the positions sparse prefix-cache retention must keep;
* :mod:`.attention` - attention partial keys at the kept positions;
* patches ``prompt_tail_split`` (end a chunk there), ``prompt_tail_manager``
  (keep the state found there, drop a native one the value does not keep),
  ``prompt_tail_retention`` (retention keeps a kept full Mamba block) and
  ``prompt_tail_attention`` (the attention group reaches each kept position).
"""

from hybrid_kv_plugin.prompt_tail.binding import MANAGER_POLICY_ATTR, policy_of
from hybrid_kv_plugin.prompt_tail.policy import PromptTailPolicy

__all__ = ["MANAGER_POLICY_ATTR", "PromptTailPolicy", "policy_of"]
