"""When each fragment of the parameters crosses nodes, and which elements make up each fragment. Pure
arithmetic, no torch: testable without processes.

Steps are counted from 1 (step ``t`` is the ``t``-th optimizer step of the run, resumed runs included). With
``sync_every=H`` and ``sync_fragments=F``, fragment ``f`` is sent after the steps ``t`` with
``t % H == offset(f)``, ``offset(f) = ((f + 1) * H // F) % H``: every fragment every ``H`` steps, the fragments
staggered ``H / F`` steps apart, fragment ``F - 1`` (the only one when ``F = 1``) after steps ``H, 2H, ...``.
With ``max_staleness=d`` the result of a sync sent after step ``t`` is applied after step ``t + d``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncSchedule:
    every: int
    fragments: int = 1
    staleness: int = 0

    def offset(self, fragment: int) -> int:
        return ((fragment + 1) * self.every // self.fragments) % self.every

    def sent_after(self, step: int) -> list[int]:
        """The fragments whose outer sync starts after optimizer step ``step``."""
        if step < 1:
            return []
        return [f for f in range(self.fragments) if step % self.every == self.offset(f)]

    def applied_after(self, step: int) -> list[int]:
        """The fragments whose outer sync result is applied after optimizer step ``step``."""
        return self.sent_after(step - self.staleness)


def fragment_bounds(total: int, fragments: int) -> list[int]:
    """The ``fragments + 1`` boundaries of ``fragments`` contiguous ranges of equal size (to one element) over the
    ``total`` elements of the flat parameters (the buckets' in order): fragment ``f`` is
    ``[bounds[f], bounds[f + 1])``, cutting across parameters where it falls, so every sync carries the same bytes
    (fragments made of whole parameters are as uneven as the parameters: one large matrix is a fragment of its
    own, and its sync the one that cannot hide behind a step)."""
    if not 1 <= fragments <= total:
        raise ValueError(f"cannot make {fragments} fragments of {total} elements")
    return [f * total // fragments for f in range(fragments + 1)]
