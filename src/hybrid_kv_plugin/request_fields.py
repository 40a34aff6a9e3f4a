"""Request fields read in C: for rules that scan many requests at each step or admission."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from itertools import compress
from operator import attrgetter
from typing import Any

# ``map(computed_tokens_of, requests)``: each request's computed tokens, no Python frame per request.
computed_tokens_of = attrgetter("num_computed_tokens")
_status_of = attrgetter("status")


def requests_in_status(requests: Collection[Any], status: Any) -> Iterator[Any]:
    """The requests of ``requests`` whose status is ``status``, in iteration order.

    ``status`` is a ``RequestStatus`` (an IntEnum, so its ``__eq__`` runs in C): no Python
    frame runs per request. ``requests`` is iterated twice in step, so it must be a list, or
    a set that nothing changes until the result is consumed.
    """
    return compress(requests, map(status.__eq__, map(_status_of, requests)))
