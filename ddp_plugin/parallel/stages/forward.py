"""A module's call replaced for a while: the pipelined model's call captured while a step runs (the schedule's
placeholders, the split by time's search for a microbatch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


@contextmanager
def forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Inside, ``module``'s call runs ``forward`` (set on the instance); on exit the instance's own ``forward``
    attribute is back as it was (none, or an earlier replacement)."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.__dict__["forward"]
        else:
            module.forward = previous
