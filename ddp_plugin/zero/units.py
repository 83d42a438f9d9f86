"""ZeRO stage 3 units: which modules share one gathered bucket of parameters, and their lifecycle.

A unit's parameters are gathered before its forward, freed after it, gathered again before its backward (a
hook on its outputs' gradients) and freed once backward has produced all of its gradients. The next units in
forward order (previous in backward order), ``prefetch`` of them, are gathered ahead, asynchronously, while the
current one computes. Parameters shared by several units (tied weights)
and those of no unit live in the root unit, which stays gathered. A unit is always made of modules that are
called: a container (``nn.ModuleList``, ``nn.ModuleDict``) is never one, since its forward hooks never fire;
the blocks inside it are grouped into units instead.

(About 400 lines: the plan of units from the module tree, and their gathers and frees at run time, which share
the unit structure and are read together.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ddp_plugin.gradients.engine import pack
from ddp_plugin.hookspecs import local_tensor, set_local_data
from ddp_plugin.parallel.module_classes import as_entries, class_names, containers, matches, unmatched

if TYPE_CHECKING:
    from ddp_plugin.zero.shards import Shards

DEFAULT_UNIT_PARAMS = 1_000_000


def is_called(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own. Containers (``nn.ModuleList``, ``nn.ModuleDict``, parameter
    lists, a plain ``nn.Module`` used as a namespace) have none: their parent calls their children, never them,
    so hooks on them never fire and they cannot be stage 3 units."""
    return type(module).forward is not nn.Module.forward


def check_auto_wrap_policy(policy: Any) -> int | tuple[type | str, ...]:
    """None -> the default parameter count; an int -> that count; module classes or class names -> those."""
    if policy is None:
        return DEFAULT_UNIT_PARAMS
    if isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 1:
            raise ValueError(f"`auto_wrap_policy={policy}` must be a positive parameter count.")
        return policy
    if (items := as_entries(policy)) is not None:
        if names := containers(items):
            raise ValueError(
                f"`auto_wrap_policy` names {', '.join(names)}, a container whose forward is never called"
                " (its parent calls its children), so a unit made of it would never be gathered; name the"
                " class of the modules it holds instead (e.g. your transformer block)."
            )
        return items
    raise ValueError(
        f"`auto_wrap_policy={policy!r}` is not supported; allowed values: None (units of at least"
        f" {DEFAULT_UNIT_PARAMS:,} parameters), a positive parameter count, or module classes (or their names,"
        " e.g. ['TransformerBlock']) whose instances become units."
    )


# ---------------------------------------------------------------------------------------------- planning


@dataclass
class UnitPlan:
    """The units' buckets of a model, in launch order (backward finishes the units registered last first; the root
    unit, named ``""``, last of all), each with its unit's name and its parameters (a unit has several buckets
    where it holds a ``solo`` parameter, or more bytes than a bucket's cap), and the names of the modules each
    unit is made of."""

    order: list[tuple[str, list[tuple[str, nn.Parameter]]]]
    members: dict[str, list[str]]
    modules: dict[str, nn.Module]

    def bucket_groups(self) -> list[list[tuple[str, nn.Parameter]]]:
        """One bucket per entry of ``order``, its parameters in the order backward produces their gradients."""
        return [list(reversed(params)) for _, params in self.order]


def plan_units(module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]], policy: int | tuple,
               solo: Sequence[nn.Parameter] = (), cap_bytes: int | None = None) -> UnitPlan:
    """Group ``named_params`` into units by ``policy`` (a parameter count, or module classes/names). Each
    parameter of ``solo`` (one several pipeline stages hold) gets a bucket of its own in its unit, ahead of the
    unit's other parameters, so that its shards line up with its copies' on the other stages. A unit of more than
    ``cap_bytes`` has its parameters packed into buckets of at most that, in the order backward produces their
    gradients (a larger parameter alone): the first is reduced while backward still fills the next, so a rank
    holds a bucket's gradients and the one being reduced, not two whole units' (it is gathered and freed whole)."""
    # A unit is one module, or several modules held by one container (named "a+b+..."), all of them called.
    groups = _unit_roots(module, policy)
    members = {"+".join(g): g for g in groups}
    unit_of_root = {r: "+".join(g) for g in groups for r in g}
    owners: dict[int, set[str]] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(mname)

    def unit_of(mname: str) -> str:
        best = ""
        for r in unit_of_root:
            if (mname == r or mname.startswith(r + ".")) and len(r) > len(best):
                best = r
        return unit_of_root.get(best, "")

    params_of: dict[str, list[tuple[str, nn.Parameter]]] = {}
    first_seen: dict[str, int] = {}
    for pos, (name, p) in enumerate(named_params):
        units = {unit_of(m) for m in owners.get(id(p), {""})}
        unit = units.pop() if len(units) == 1 else ""  # shared by several units: the root keeps it
        params_of.setdefault(unit, []).append((name, p))
        first_seen.setdefault(unit, pos)
    order = sorted((u for u in params_of if u), key=lambda u: -first_seen[u])
    if "" in params_of:
        order.append("")
    alone = {id(p) for p in solo}
    entries = []
    for u in order:
        params = params_of[u]
        own = [(name, p) for name, p in params if id(p) in alone]
        if own and len(own) < len(params):
            entries += [(u, [named]) for named in own]
            params = [(n, p) for n, p in params if id(p) not in alone]
        entries += [(u, chunk) for chunk in _split(params, cap_bytes)]
    return UnitPlan(order=entries, members=members, modules=dict(module.named_modules()))


def _split(params: list[tuple[str, nn.Parameter]], cap_bytes: int | None) -> list[list[tuple[str, nn.Parameter]]]:
    """A unit's parameters (in registration order) as buckets of at most ``cap_bytes``, in launch order, each in
    registration order; one bucket where they fit."""
    if cap_bytes is None or sum(local_tensor(p).numel() * p.element_size() for _, p in params) <= cap_bytes:
        return [params]
    return [list(reversed(chunk)) for chunk in pack(list(reversed(params)), cap_bytes)]


def _unit_roots(module: nn.Module, policy: int | tuple) -> list[list[str]]:
    """The units' modules: each unit is a list of module names (one module, or several held by one container),
    and every one of them is called (``is_called``), so its forward hooks fire."""
    if isinstance(policy, int):
        return _units_by_count(module, policy)
    matched = [(name, m) for name, m in module.named_modules() if name and matches(m, policy)]
    present = class_names(module)
    if missing := unmatched((m for _, m in matched), policy):
        raise ValueError(
            f"`auto_wrap_policy` names {missing[0]!r}, which matches no module of {type(module).__name__}; module"
            f" classes in this model: {', '.join(present[:12])}{' ...' if len(present) > 12 else ''}."
            " Name one of them (or pass a parameter count)."
        )
    for name, m in matched:
        if not is_called(m):
            raise ValueError(
                f"`auto_wrap_policy` names {type(m).__name__!r}: `{name}` is a container whose forward is never"
                " called (its parent calls its children), so a unit made of it would never be gathered; name"
                " the class of the modules it holds instead."
            )
    return [[name] for name, _ in matched]


def _units_by_count(module: nn.Module, size: int) -> list[list[str]]:
    """Bottom-up: a called module whose parameters not yet in a unit reach ``size`` becomes a unit. A
    container is never one: the called modules inside it that are in no unit yet are grouped, in order,
    into runs of at least ``size`` parameters, each run a unit; what is left goes up to the enclosing
    module (the root unit at the top)."""
    units: list[list[str]] = []
    assigned: set[int] = set()

    def own(m: nn.Module) -> int:
        return sum(local_tensor(p).numel() for p in m._parameters.values()
                   if p is not None and p.requires_grad and id(p) not in assigned)

    def claim(names: list[str], modules: list[nn.Module]) -> None:
        units.append(names)
        for m in modules:
            assigned.update(id(p) for p in m.parameters())

    def visit(name: str, m: nn.Module) -> tuple[int, list[tuple[str, nn.Module, int]]]:
        """Parameters left over in this subtree, and the called modules that hold them (with their counts;
        a container's own parameters belong to none of them)."""
        results = [visit(f"{name}.{child_name}" if name else child_name, child)
                   for child_name, child in m.named_children()]
        count = own(m) + sum(c for c, _ in results)
        if is_called(m) or not name:
            if name and count >= size:
                claim([name], [m])
                return 0, []
            return count, ([(name, m, count)] if count else [])
        # Parameters of containers (e.g. a ParameterList) are used by an enclosing module's forward: they
        # go up with what is left, never into a run.
        loose = own(m) + sum(c - sum(pc for _, _, pc in pieces) for c, pieces in results)
        run: list[tuple[str, nn.Module, int]] = []
        for piece in (piece for _, pieces in results for piece in pieces):
            run.append(piece)
            if sum(c for _, _, c in run) >= size:
                claim([n for n, _, _ in run], [mm for _, mm, _ in run])
                run = []
        return loose + sum(c for _, _, c in run), run

    visit("", module)
    return units


# ---------------------------------------------------------------------------------------------- lifecycle


@dataclass(eq=False)
class Unit:
    """The modules whose forward needs one bucket's parameters gathered (two buckets where a parameter several
    pipeline stages hold was given a bucket of its own: :func:`plan_units`'s ``solo``)."""

    name: str
    buckets: list[int]
    persistent: bool  # the root unit stays gathered
    modules: list[nn.Module] = field(default_factory=list)
    gathered: bool = True
    waiting: set[int] = field(default_factory=set)  # ids of the modules whose forward has yet to run this pass
    pending: list[Any] | None = None  # a prefetch in flight (what Shards.gather returned, per bucket)
    remaining: int = 0  # gradients still to come in this backward


class Units:
    """Stage 3 at run time: the units over ``shards`` (whose non-root units hold only their shard at first),
    the module hooks that gather and free them, and the peak of gathered bytes (metrics)."""

    def __init__(self, plan: UnitPlan, shards: Shards, prefetch: int = 2, hold: bool = False) -> None:
        self.shards = shards
        self.prefetch = prefetch
        """Units gathered ahead of the one running (0: none; 1: the next, as FSDP; 2: the next two, the default)."""
        self.hold = hold
        """Keep a unit gathered from its first forward with gradients until the sharder frees every unit (after
        the step's backward, and after the optimizer step): for pipeline stages, whose microbatches each run the
        stage's forward and backward, which would otherwise gather every unit 2M times a step (torchtitan keeps
        FSDP's units gathered under pipeline parallelism too, ``reshard_after_forward=False``)."""
        self.units: list[Unit] = []
        self.of_bucket: dict[int, Unit] = {}
        self.handles: list[Any] = []
        self.forward_order: list[Unit] = []
        self.order_known = False
        named: dict[str, Unit] = {}
        for b, (uname, _) in enumerate(plan.order):
            if uname in named:  # (a second bucket of the unit)
                named[uname].buckets.append(b)
                self.of_bucket[b] = named[uname]
                continue
            unit = Unit(name=uname or "<root>", buckets=[b], persistent=not uname, gathered=not uname)
            self.units.append(unit)
            self.of_bucket[b] = unit
            if not unit.persistent:
                named[uname] = unit
                for member in plan.members[uname]:
                    self._register_hooks(unit, plan.modules[member])
        for bucket in shards.buckets:
            unit = self.of_bucket[bucket.index]
            for p in bucket.params:
                self.handles.append(p.register_post_accumulate_grad_hook(self._make_grad_done(unit)))
        self.peak_gathered_bytes = self.fit_peak_gathered_bytes = shards.gathered_bytes()
        self.gathers = 0
        """Units gathered since the last metrics collection (one step): ``zero/unit_gathers``."""
        self.after_gather: Callable[[int], None] | None = None
        """Called with each bucket of a unit once its gather is done (offload drops the shard's pages there)."""

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # ------------------------------------------------------------------ gather and free

    def _finish(self, unit: Unit) -> None:
        if unit.pending is not None:
            for b, pending in zip(unit.buckets, unit.pending):
                self.shards.finish_gather(self.shards.entries[b].full, pending)
            unit.pending = None
            self._gathered(unit)

    def _gathered(self, unit: Unit) -> None:
        if self.after_gather is not None:
            for b in unit.buckets:
                self.after_gather(b)

    def free(self, unit: Unit) -> None:
        self._finish(unit)
        for b in unit.buckets:
            self.shards.entries[b].full.untyped_storage().resize_(0)
        unit.gathered = False

    def _start_gather(self, unit: Unit, async_op: bool) -> None:
        self.gathers += 1
        pending = []
        for b in unit.buckets:
            entry = self.shards.entries[b]
            entry.full.untyped_storage().resize_(entry.full.numel() * entry.full.element_size())
            pending.append(self.shards.gather(entry.full, entry.shard, async_op=async_op))
        unit.gathered = True
        unit.pending = pending if async_op else None
        if not async_op:
            self._gathered(unit)
        now = self.shards.gathered_bytes()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)
        self.fit_peak_gathered_bytes = max(self.fit_peak_gathered_bytes, now)

    def gather(self, unit: Unit) -> None:
        if not unit.gathered:
            self._start_gather(unit, async_op=False)
        else:
            self._finish(unit)

    def gather_all_into(self, make_full: Callable[[int], Tensor], done: Callable[[int], None]) -> None:
        """Gather every unit into a new flat tensor per bucket, ``make_full(b)`` (e.g. a mapped file, where the model
        does not fit in memory whole), which the parameters then view; ``done(b)`` after each bucket's gather. For
        after ``fit``: such a unit is not freed again."""
        for unit in self.units:
            if unit.persistent:
                continue
            if unit.gathered:
                self.free(unit)
            for b in unit.buckets:
                entry, bucket = self.shards.entries[b], self.shards.buckets[b]
                full = make_full(b)
                self.shards.gather(full, entry.shard)
                for i, p in enumerate(bucket.params):
                    local = local_tensor(p)
                    set_local_data(p, full[bucket.offsets[i] : bucket.offsets[i] + local.numel()].view_as(local))
                entry.full = full
                done(b)
            unit.gathered = True

    def gather_all(self) -> None:
        for unit in self.units:
            self.gather(unit)

    def free_all(self) -> None:
        for unit in self.units:
            if not unit.persistent and unit.gathered:
                self.free(unit)

    def _prefetch(self, unit: Unit, step: int) -> None:
        """Start gathering the ``prefetch`` units after ``unit`` in forward order (``step`` +1) or before it
        (backward, -1), asynchronously: their all-gathers run while ``unit`` computes."""
        if not self.order_known or unit not in self.forward_order:
            return
        at = self.forward_order.index(unit)
        for ahead in range(1, self.prefetch + 1):
            i = at + step * ahead
            if 0 <= i < len(self.forward_order):
                nxt = self.forward_order[i]
                if not nxt.gathered:
                    self._start_gather(nxt, async_op=True)

    # ------------------------------------------------------------------ hooks

    def _register_hooks(self, unit: Unit, module: nn.Module) -> None:
        """Hooks on one of the unit's modules (a unit of several siblings gets them on each): the first forward
        of the unit in a pass gathers it, and it is freed once every one of its modules has run (a module that
        runs again later gathers it again)."""
        unit.modules.append(module)

        def pre_forward(_module: nn.Module, _args: Any) -> None:
            if not unit.gathered or not unit.waiting:
                unit.waiting = {id(m) for m in unit.modules}
            self.gather(unit)
            if not self.order_known and unit not in self.forward_order:
                self.forward_order.append(unit)
            if torch.is_grad_enabled():
                self._prefetch(unit, +1)

        def post_forward(_module: nn.Module, _args: Any, output: Any) -> Any:
            unit.waiting.discard(id(_module))
            if not unit.waiting and not (self.hold and torch.is_grad_enabled()):
                self.free(unit)
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            if tensors and torch.is_grad_enabled():
                unit.remaining = sum(len(self.shards.buckets[b].params) for b in unit.buckets)

                def pre_backward(_grads: Any) -> None:
                    self.gather(unit)
                    self._prefetch(unit, -1)

                torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")
            return output

        self.handles.append(module.register_forward_pre_hook(pre_forward))
        self.handles.append(module.register_forward_hook(post_forward))

    def _make_grad_done(self, unit: Unit):
        def grad_done(_p: nn.Parameter) -> None:
            if unit.persistent:
                return
            unit.remaining -= 1
            if unit.remaining == 0 and unit.gathered and not self.hold:
                self.free(unit)

        return grad_done

    @property
    def largest_unit_bytes(self) -> int:
        """Bytes of the largest unit's gathered parameters (what forward and backward add to the shards; up to
        1 + ``prefetch`` times that while the next units are prefetched). The root unit, always gathered, counts
        too."""
        entries = self.shards.entries
        return max((sum(entries[b].full.numel() * entries[b].full.element_size() for b in u.buckets)
                    for u in self.units),
                   default=0)
