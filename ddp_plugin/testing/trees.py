"""Walking a checkpoint: the leaves of nested dicts, lists and tuples, with where each one is.

    residuals = [v for path, v in leaves(ckpt["ddp_plugin"]) if "residual" in path]
    tensor_types = {type(v).__name__ for _, v in leaves(checkpoint) if isinstance(v, torch.Tensor)}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["leaves"]


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` for every value in ``tree`` that is not a dict, list or tuple, depth first in order;
    ``path`` joins the keys and indices on the way with ``/`` (``"/optimizer_states/0/state/3/exp_avg"``)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, tree
