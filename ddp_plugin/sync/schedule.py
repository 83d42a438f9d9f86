"""When each fragment of the parameters crosses nodes, and which parameters make up each fragment. Pure
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


def plan_fragments(sizes: list[int], fragments: int) -> list[int]:
    """Assign parameters (given by their sizes, in order) to ``fragments`` contiguous runs of about equal size;
    returns the fragment of each parameter. Every fragment gets at least one parameter."""
    n = len(sizes)
    if not 1 <= fragments <= n:
        raise ValueError(f"cannot make {fragments} fragments of {n} parameters")
    total = sum(sizes)
    out: list[int] = []
    f, acc = 0, 0
    for i, size in enumerate(sizes):
        # Move to the next fragment when this parameter's middle passes the fragment's share, and leave one
        # parameter for each fragment still to come.
        if out and f < fragments - 1 and (acc + size / 2 >= total * (f + 1) / fragments or n - i == fragments - 1 - f):
            f += 1
        out.append(f)
        acc += size
    return out
