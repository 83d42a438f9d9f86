"""Test matrices that cover every pair of factors instead of every combination.

A bug that shows only with two settings together (a codec at a ZeRO stage, a layout with a sync mode) needs a case
with that pair; one that needs three particular settings together is rarer. :func:`covering_pairs` picks cases
from the full product until every pair of two factors' values is in one of them: for a codec, a stage and a layout
(9 x 4 x 5, 180 combinations) about 46 cases, the product of the two largest factors being the least possible.
The suite runs those, and ``pytest --full-matrix`` runs every combination (docs/testing.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence


def covering_pairs(factors: Mapping[str, Sequence], allowed: Callable[[dict], bool] | None = None,
                   required: Sequence[tuple] = ()) -> list[tuple]:
    """Cases (tuples in the order of ``factors``) in which every pair of values of two factors occurs, among the
    combinations ``allowed`` accepts (given ``{factor: value}``; all by default), starting with ``required`` (the
    cases that guard a fixed bug). Greedy and deterministic: each next case is the first combination, in the
    product's order, that covers the most pairs not yet covered; the same factors give the same cases on every
    machine and run."""
    names = list(factors)
    rows = [row for row in itertools.product(*factors.values())
            if allowed is None or allowed(dict(zip(names, row)))]

    def pairs(row: tuple) -> set[tuple]:
        return pairs_covered((row,))

    uncovered = set().union(*map(pairs, rows)) if rows else set()
    chosen: list[tuple] = []
    for row in required:
        if row not in rows:
            raise ValueError(f"required case {row} is not among the allowed combinations")
        chosen.append(tuple(row))
        uncovered -= pairs(tuple(row))
    while uncovered:
        best = max(rows, key=lambda row: len(pairs(row) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def pairs_covered(cases: Iterable[tuple]) -> set[tuple]:
    """Every ``(i, value, j, value)`` pair of factors ``i < j`` some case holds (to check a hand-written set)."""
    return {(i, row[i], j, row[j]) for row in cases for i, j in itertools.combinations(range(len(row)), 2)}
