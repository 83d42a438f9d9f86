"""A block cut between two pipeline stages: its first part (up to a point inside its ``forward``) ends one stage and
its second part starts the next, so that stages need not hold whole blocks (``pipeline_split="time"`` and named
cuts: docs/pipeline.md).

The block's ``forward`` is traced with ``torch.fx`` (every module it calls a leaf: its children run as they are) and
cut before the first use of one of its attributes. A cut holds where one value crosses it: exactly one value
computed before it is used after it, the block's first argument (the hidden state) is not used after it, and the
block returns one value; its other arguments reach both parts (the model calls each part as it called the block).
Each part is the block itself, the other part's attributes removed and its ``forward`` (an attribute of the
instance, as activation checkpointing sets one) the traced graph's part: names, class and hooks stay the block's,
so state dicts keep the unsplit model's names.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from torch import fx, nn


@dataclass(frozen=True)
class Cut:
    """A block's cut: before the first use of its attribute ``at``; ``first`` and ``second`` are the block's
    attributes (children, parameters, buffers) each part holds."""

    at: str
    first: tuple[str, ...]
    second: tuple[str, ...]


class _Leaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True  # the block's own forward is traced; the modules it calls run whole


def _graph(block: nn.Module) -> fx.Graph:
    return _Leaves().trace(block)


def _attribute(node: fx.Node) -> str | None:
    """The block's attribute a node uses (``"attn"`` for ``self.attn.q(...)``), or ``None``."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target).split(".")[0]
    return None


def _parts(graph: fx.Graph) -> tuple[list[fx.Node], list[fx.Node], fx.Node]:
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    return placeholders, [n for n in nodes if n.op not in ("placeholder", "output")], output


def _check(graph: fx.Graph, names: list[str], at: str) -> tuple[Cut, int, fx.Node] | str:
    """The cut before the first use of ``at`` (with the index of that node and the value crossing it), or why it
    does not hold."""
    placeholders, body, output = _parts(graph)
    index = next((i for i, n in enumerate(body) if _attribute(n) == at), None)
    if index is None:
        return f"its `forward` does not use `{at}`"
    if not placeholders:
        return "its `forward` takes no argument"
    if not isinstance(output.args[0], fx.Node):
        return "it returns several values (a cut block must return one tensor)"
    before, after = body[:index], body[index:]
    first = {a for n in before if (a := _attribute(n))}
    second = {a for n in after if (a := _attribute(n))}
    if not first:
        return f"nothing with parameters runs before `{at}`"
    if first & second:
        return f"{', '.join(f'`{a}`' for a in sorted(first & second))} runs both before and after `{at}`"
    users = set(after) | {output}
    crossing = [n for n in before if any(u in users for u in n.users)]
    if placeholders[0] in {a for n in users for a in n.all_input_nodes}:
        return f"its first argument (`{placeholders[0].name}`, the hidden state) is used after `{at}` as well"
    if len(crossing) != 1:
        return (f"{len(crossing)} values computed before `{at}` are used after it"
                f" ({', '.join(n.name for n in crossing)}); a cut passes one")
    # attributes used by neither part stay with the first
    second_names = tuple(a for a in names if a in second)
    first_names = tuple(a for a in names if a not in second)
    return Cut(at, first_names, second_names), index, crossing[0]


def _attributes(block: nn.Module) -> list[str]:
    return [*block._modules, *block._parameters, *block._buffers]


def find(block: nn.Module, at: str) -> Cut:
    """The cut of ``block`` before the first use of its attribute ``at``; ``ValueError`` saying why where it does
    not hold (or the block's ``forward`` does not trace)."""
    try:
        graph = _graph(block)
    except Exception as err:  # noqa: BLE001 (fx's errors are of many types; the reason is in the message)
        raise ValueError(f"its `forward` does not trace with torch.fx ({type(err).__name__}: {err})") from err
    found = _check(graph, _attributes(block), at)
    if isinstance(found, str):
        raise ValueError(found)
    return found[0]


def candidates(block: nn.Module) -> list[Cut]:
    """Every cut that holds in ``block``, in the order its ``forward`` runs them (none where it does not trace)."""
    try:
        graph = _graph(block)
    except Exception:  # noqa: BLE001 (a block that does not trace is cut between blocks only)
        return []
    names, seen, cuts = _attributes(block), set(), []
    for node in _parts(graph)[1]:
        at = _attribute(node)
        if at is not None and at not in seen:
            seen.add(at)
            found = _check(graph, names, at)
            if not isinstance(found, str):
                cuts.append(found[0])
    return cuts


def keep_part(block: nn.Module, cut: Cut, second: bool) -> nn.Module:
    """Turn ``block`` into its first part (``second=False``) or its second, in place: the other part's attributes
    removed and ``forward`` the traced part. Returns ``block``."""
    graph = _graph(block)
    found = _check(graph, _attributes(block), cut.at)
    if isinstance(found, str):
        raise ValueError(found)
    _, index, crossing = found
    placeholders, body, output = _parts(graph)
    part = fx.Graph()
    env: dict[fx.Node, Any] = {}
    if second:
        for i, node in enumerate(placeholders):
            env[crossing if i == 0 else node] = part.node_copy(node, lambda n: env[n])
        for node in body[index:]:
            env[node] = part.node_copy(node, lambda n: env[n])
        part.output(fx.map_arg(output.args[0], lambda n: env[n]))
    else:
        for node in placeholders:
            env[node] = part.node_copy(node, lambda n: env[n])
        for node in body[:index]:
            env[node] = part.node_copy(node, lambda n: env[n])
        part.output(env[crossing])
    code = fx.GraphModule(block, part)  # (generates the part's code; its attributes are the block's)
    for name in cut.first if second else cut.second:
        for table in (block._modules, block._parameters, block._buffers):
            table.pop(name, None)
    block.forward = types.MethodType(type(code).forward, block)
    return block
