"""The ZeRO sharder: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) split across ranks.

Every gradient bucket is split into P equal shards (the engine pads buckets to a multiple of the world size).
With ``shard_scope="global"`` P is the world size; with ``"node"`` P is the ranks per node, and each node holds
a full replica (HSDP, DeepSpeed ZeRO++ hpZ): parameter all-gathers never cross the slow link, at the price of
P times more memory for the sharded parts.

One step, for every stage:

1. backward: as each bucket fills, it is reduced to this rank's shard only: an intra-node reduce-scatter, then
   ``on_cross_node_reduce`` on the node's share (so codecs compress it), then, with global scope, the slice of
   it this rank owns. Without a hierarchy (one node, or ``hierarchical=False``) the cross-node hook runs on the
   whole bucket over the world and the shard is sliced out.
2. the optimizer steps only this rank's shard: the user's optimizer object is kept, but its parameter groups
   now hold 1-D pieces of the shards (a parameter cut by a shard boundary becomes two pieces on two ranks), so
   its state exists for 1/P of the elements. Elementwise optimizers (SGD, Adam, AdamW, ...) compute exactly
   what they would on whole tensors.
3. after the step the updated shards are all-gathered into the flat parameter buffers every module parameter
   views (stages 1 and 2), or left sharded until the next forward needs them (stage 3).

Stage 1 keeps every bucket's gradient buffer and fills all of it with the mean (the reduction ends with an
all-gather of the reduced parts, inside the node where it can), so every module parameter's ``.grad`` holds its
whole averaged gradient from the end of backward until the next backward, as under DDP; the optimizer steps the
shard's slice of it. Stages 2 and 3 release the buffers as soon as their shard is reduced, keeping only the
shard's gradient; ``on_gather_full_gradients`` lends the whole gradients to the module on demand and
``on_grad_norms`` computes their norms from the shards.

Stage 3 groups parameters into units (modules chosen by ``auto_wrap_policy``); a unit's parameters are
gathered before its forward, freed after it, gathered again before its backward (a hook on its outputs'
gradients) and freed once backward has produced all of its gradients. The next unit in forward order (previous
in backward order) is prefetched. Parameters shared by several units (tied weights) and those of no unit live
in the root unit, which stays gathered. Frozen parameters are not sharded.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ddp_plugin import collectives
from ddp_plugin.hookspecs import DeferredStorage, DeferredTensor, completed_future, hookimpl
from ddp_plugin.plugins.mean_allreduce import MeanAllReduce

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch.optim import Optimizer

    from ddp_plugin.hookspecs import Bucket, Topology

log = logging.getLogger(__name__)

SHARD_SCOPES = ("global", "node")
DEFAULT_UNIT_PARAMS = 1_000_000

# Optimizers whose update of an element depends only on that element's gradient and state: stepping 1-D
# pieces of the parameters computes exactly what stepping whole tensors would.
ELEMENTWISE_OPTIMIZERS: list[type] = [
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.ASGD,
]
_WHY_NOT = {
    "LBFGS": "it re-evaluates the closure and keeps a history over all parameters as one vector",
    "SparseAdam": "it needs sparse gradients, and shards are dense",
    "Adafactor": "it factors the second moment over the rows and columns of each matrix, which a flat shard"
    " does not have",
    "Muon": "it orthogonalizes each whole matrix update, which a flat shard does not have",
}


def allow_optimizer(cls: type) -> type:
    """Declare an optimizer class elementwise (each element's update depends only on its own gradient and
    state), so ZeRO stages accept it. Usable as a class decorator.

    This is also how to vouch for a subclass of an allowed optimizer: the check takes exact classes only,
    because a subclass may change the update (a per-tensor trust ratio, a norm over a whole matrix) and would
    then train to another result sharded than unsharded, silently. Declaring a class does not declare its
    subclasses."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"allow_optimizer takes an optimizer class (a torch.optim.Optimizer subclass), got {cls!r}.")
    if cls not in ELEMENTWISE_OPTIMIZERS:
        ELEMENTWISE_OPTIMIZERS.append(cls)
    return cls


_GATHER_CHUNK = 1 << 18
"""Elements per ``dist.gather`` when checkpoint state is gathered to rank 0 (1 MiB of fp32 per rank)."""


def check_optimizer(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose exact class was not declared elementwise (subclasses included: see
    :func:`allow_optimizer`). Called on every rank, so every rank fails with this message."""
    cls = type(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS:
        return
    name = cls.__name__
    parent = next((c for c in cls.__mro__[1:] if c in ELEMENTWISE_OPTIMIZERS), None)
    if parent is not None:
        why = (
            f"it subclasses {parent.__name__}, and a subclass may change the update (e.g. a per-tensor trust ratio,"
            " as LARS and LAMB have), which would train to another result on shards than on whole tensors"
        )
    else:
        why = _WHY_NOT.get(name, "ddp_plugin does not know whether its update is elementwise")
    raise ValueError(
        f"ZeRO stages 1-3 cannot shard the optimizer {name}: {why}. Sharded optimizers must update each element"
        f" from its own gradient and state ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}). Use one of"
        f" those, `zero_stage=0`, or, if {name}'s update is elementwise, declare it before `fit` with"
        f" `ddp_plugin.plugins.zero_sharder.allow_optimizer({name})`."
    )


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
    if isinstance(policy, (type, str)):
        policy = [policy]
    if isinstance(policy, Iterable):
        items = tuple(policy)
        if items and all(isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)) for c in items):
            containers = [c.__name__ for c in items if isinstance(c, type) and c.forward is nn.Module.forward]
            if containers:
                raise ValueError(
                    f"`auto_wrap_policy` names {', '.join(containers)}, a container whose forward is never called"
                    " (its parent calls its children), so a unit made of it would never be gathered; name the"
                    " class of the modules it holds instead (e.g. your transformer block)."
                )
            return items
    raise ValueError(
        f"`auto_wrap_policy={policy!r}` is not supported; allowed values: None (units of at least"
        f" {DEFAULT_UNIT_PARAMS:,} parameters), a positive parameter count, or module classes (or their names,"
        " e.g. ['TransformerBlock']) whose instances become units."
    )


@dataclass(eq=False)
class _Unit:
    """Stage 3: the modules whose forward needs one bucket's parameters gathered."""

    name: str
    modules: list[nn.Module]
    bucket: int = -1
    persistent: bool = False  # the root unit stays gathered
    gathered: bool = True
    waiting: set[int] = field(default_factory=set)  # ids of the modules whose forward has yet to run this pass
    pending: Any = None  # a prefetch in flight: (work, block or None)
    remaining: int = 0  # gradients still to come in this backward


@dataclass(eq=False)
class _Shard:
    """One bucket's share on this rank."""

    full: Tensor  # the flat parameters every module parameter views (memory released at stage 3)
    shard: Tensor  # this rank's part of ``full`` (a view of it, or, at stage 3, a tensor of its own)
    grad: Tensor | None = None  # the reduced gradient of ``shard`` (stages 2 and 3)
    pieces: list[tuple[nn.Parameter, int, int, int]] = field(default_factory=list)
    """(piece, index of the parameter in the bucket, start in the parameter, start in the shard)"""


class ZeroSharder:
    """ZeRO stage 1, 2 or 3 over ``shard_scope`` ("global": every rank; "node": the ranks of a node)."""

    def __init__(self, stage: int, shard_scope: str = "global", auto_wrap_policy: Any = None) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"`zero_stage={stage!r}`: the sharder handles stages 1, 2, 3.")
        if shard_scope not in SHARD_SCOPES:
            raise ValueError(f"`shard_scope={shard_scope!r}` is not supported; allowed values: 'global', 'node'.")
        self.stage = stage
        self.shard_scope = shard_scope
        self.policy = check_auto_wrap_policy(auto_wrap_policy)
        self._hook: HookRelay | None = None
        self._topo: Topology | None = None
        self._buckets: list[Bucket] = []
        self._shards: list[_Shard] = []
        self._units: list[_Unit] = []
        self._unit_of_bucket: dict[int, _Unit] = {}
        self._planned: list[tuple[str, list[tuple[str, nn.Parameter]]]] | None = None
        self._unit_members: dict[str, list[str]] = {}  # unit name -> the names of the modules it is made of
        self._handles: list[Any] = []
        self._forward_order: list[_Unit] = []
        self._order_known = False
        self._pieces_of: dict[int, list[nn.Parameter]] = {}
        self._original_groups: dict[int, list[list[nn.Parameter]]] = {}
        self._plain: bool | None = None  # see _plain_cross_node_mean
        self._ws: dict[str, Tensor] = {}  # see _workspace
        self._grads_published = False  # stage 1: see _register_stage_1_hooks
        self._lent: list[tuple[nn.Parameter, Tensor | None]] = []  # on_gather_full_gradients: (parameter, its .grad)
        self._lent_depth = 0
        self.peak_gathered_bytes = 0
        """Stage 3: the most parameter bytes gathered at once since the last metrics collection (one step)."""
        self.fit_peak_gathered_bytes = 0
        """Stage 3: the same over the whole ``fit``."""

    # ------------------------------------------------------------------ layout

    @property
    def _hierarchical(self) -> bool:
        t = self._topo
        return bool(self._options_hierarchical) and t.num_nodes > 1 and t.ranks_per_node > 1

    def _layout(self) -> str:
        t = self._topo
        if self.shard_scope == "node" or t.num_nodes == 1:
            return "node"
        return "two_level" if self._hierarchical else "world"

    @property
    def num_shards(self) -> int:
        t = self._topo
        return t.ranks_per_node if self._layout() == "node" else t.world_size

    @property
    def shard_index(self) -> int:
        t = self._topo
        layout = self._layout()
        if layout == "node":
            return t.local_rank
        if layout == "two_level":
            return t.local_rank * t.num_nodes + t.node_rank
        return t.rank

    # ------------------------------------------------------------------ stage 3 units

    @hookimpl
    def on_plan_buckets(
        self, module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]]
    ) -> list[list[tuple[str, nn.Parameter]]] | None:
        if self.stage != 3:
            return None
        # A unit is one module, or several modules held by one container (named "a+b+..."), all of them called.
        groups = self._unit_roots(module)
        self._unit_members = {"+".join(g): g for g in groups}
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

        members: dict[str, list[tuple[str, nn.Parameter]]] = {}
        first_seen: dict[str, int] = {}
        for pos, (name, p) in enumerate(named_params):
            units = {unit_of(m) for m in owners.get(id(p), {""})}
            unit = units.pop() if len(units) == 1 else ""  # shared by several units: the root keeps it
            members.setdefault(unit, []).append((name, p))
            first_seen.setdefault(unit, pos)
        # Launch order: backward finishes the units registered last first; the root unit last of all.
        order = sorted((u for u in members if u), key=lambda u: -first_seen[u])
        if "" in members:
            order.append("")
        self._planned = [(u, members[u]) for u in order]
        self._module_names = dict(module.named_modules())
        return [list(reversed(members[u])) for u in order]

    def _unit_roots(self, module: nn.Module) -> list[list[str]]:
        """The units' modules: each unit is a list of module names (one module, or several held by one container),
        and every one of them is called (``is_called``), so its forward hooks fire."""
        if isinstance(self.policy, int):
            return self._units_by_count(module, self.policy)
        classes = tuple(c for c in self.policy if isinstance(c, type))
        names = {c for c in self.policy if isinstance(c, str)}
        matched = [(name, m) for name, m in module.named_modules()
                   if name and (isinstance(m, classes) or type(m).__name__ in names)]
        present = sorted({type(m).__name__ for _, m in module.named_modules()})
        for entry in self.policy:
            label = entry if isinstance(entry, str) else entry.__name__
            if not any((type(m).__name__ == entry) if isinstance(entry, str) else isinstance(m, entry)
                       for _, m in matched):
                raise ValueError(
                    f"`auto_wrap_policy` names {label!r}, which matches no module of {type(module).__name__}; module"
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

    @staticmethod
    def _units_by_count(module: nn.Module, size: int) -> list[list[str]]:
        """Bottom-up: a called module whose parameters not yet in a unit reach ``size`` becomes a unit. A
        container is never one: the called modules inside it that are in no unit yet are grouped, in order,
        into runs of at least ``size`` parameters, each run a unit; what is left goes up to the enclosing
        module (the root unit at the top)."""
        units: list[list[str]] = []
        assigned: set[int] = set()

        def own(m: nn.Module) -> int:
            return sum(p.numel() for p in m._parameters.values()
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

    # ------------------------------------------------------------------ setup

    @hookimpl
    def on_setup(self, topology: Topology, buckets: Sequence[Bucket], hook: HookRelay,
                 options: Mapping[str, Any], module: nn.Module) -> None:
        self._topo, self._hook, self._buckets = topology, hook, list(buckets)
        self._options_hierarchical = options.get("hierarchical", True)
        self._plain = None
        p_count, idx = self.num_shards, self.shard_index
        self._shards = []
        for bucket in self._buckets:
            if bucket.numel % p_count:
                raise RuntimeError(f"bucket {bucket.index} holds {bucket.numel} elements, not a multiple of {p_count}")
            c = bucket.numel // p_count
            full = torch.zeros_like(bucket.buffer)
            for i, p in enumerate(bucket.params):
                view = full[bucket.offsets[i] : bucket.offsets[i] + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
            lo = idx * c
            shard = full[lo : lo + c]
            entry = _Shard(full=full, shard=shard)
            for i, p in enumerate(bucket.params):
                start, stop = max(bucket.offsets[i], lo), min(bucket.offsets[i] + p.numel(), lo + c)
                if start < stop:
                    entry.pieces.append((None, i, start - bucket.offsets[i], start - lo))  # type: ignore[arg-type]
            self._shards.append(entry)
            # Memory is given back bucket by bucket, so setup never holds much more than the model once: the
            # gradient buffer until backward needs it (stages 2, 3), the full parameters until forward (stage 3).
            if self.stage >= 2:
                bucket.release()
            if self.stage == 3 and self._planned is not None and self._planned[bucket.index][0]:
                entry.shard = shard.clone()
                full.untyped_storage().resize_(0)

        self._units = []
        self._unit_of_bucket = {}
        if self.stage == 3:
            assert self._planned is not None, "on_plan_buckets did not run"
            for b, (uname, _) in enumerate(self._planned):
                unit = _Unit(name=uname or "<root>", modules=[], bucket=b, persistent=not uname,
                             gathered=not uname)
                self._units.append(unit)
                self._unit_of_bucket[b] = unit
                if not unit.persistent:
                    for member in self._unit_members[uname]:
                        self._register_unit_hooks(unit, self._module_names[member])
            for bucket in self._buckets:
                unit = self._unit_of_bucket[bucket.index]
                for p in bucket.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_done(unit)))
        if self.stage == 1:
            self._register_stage_1_hooks()
        self._order_known = False
        self._forward_order = []
        # The pieces the optimizer will step: 1-D views of this rank's shards.
        # Every sharded parameter has an entry, empty where none of it is this rank's: the optimizer must not
        # step such a parameter itself (at stage 1 it has a gradient, the whole one).
        self._pieces_of = {id(p): [] for bucket in self._buckets for p in bucket.params}
        for bucket, entry in zip(self._buckets, self._shards):
            pieces = []
            for _, i, p_start, s_start in entry.pieces:
                n = min(bucket.params[i].numel() - p_start, entry.shard.numel() - s_start)
                piece = nn.Parameter(entry.shard[s_start : s_start + n], requires_grad=True)
                pieces.append((piece, i, p_start, s_start))
                self._pieces_of.setdefault(id(bucket.params[i]), []).append(piece)
            entry.pieces = pieces
        self.peak_gathered_bytes = self.fit_peak_gathered_bytes = self._gathered_now()

    @hookimpl
    def on_setup_optimizer(self, optimizer: Optimizer) -> None:
        check_optimizer(optimizer)
        # The parameters as the user gave them: checkpoints keep the layout of an unsharded optimizer.
        self._original_groups[id(optimizer)] = [list(group["params"]) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                pieces = self._pieces_of.get(id(p))
                if pieces is None:
                    params.append(p)  # frozen or not ours: left as it is
                    continue
                state = optimizer.state.pop(p, None)
                if state:
                    self._shard_state(optimizer, p, pieces, state)
                params.extend(pieces)
            group["params"] = params
        self._refuse_unsharded_access(optimizer)

    def _shard_state(self, optimizer: Optimizer, p: nn.Parameter, pieces: list[nn.Parameter], state: dict) -> None:
        """Slice a whole parameter's optimizer state (e.g. Adagrad's initial sums) for its pieces."""
        where = {id(piece): (i, p_start) for entry in self._shards for piece, i, p_start, _ in entry.pieces}
        for piece in pieces:
            _, p_start = where[id(piece)]
            optimizer.state[piece] = {
                k: (v.detach().reshape(-1)[p_start : p_start + piece.numel()].clone()
                    if isinstance(v, Tensor) and v.numel() == p.numel() and v.dim() > 0 else
                    (v.clone() if isinstance(v, Tensor) else v))
                for k, v in state.items()
            }

    @hookimpl
    def on_teardown(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.stage == 3:
            # Leave the module whole after fit (validation, export, `trainer.save_checkpoint`).
            try:
                for unit in self._units:
                    self._gather_unit(unit)
            except Exception as err:  # noqa: BLE001 - after a failed run; the original error is what matters
                log.warning("ZeRO stage 3: could not gather the parameters at teardown: %s", err)

    # ------------------------------------------------------------------ collectives

    def _workspace(self, name: str, numel: int, like: Tensor) -> Tensor:
        """A scratch tensor of ``numel`` elements, reused from bucket to bucket and step to step: the communication
        thread reduces one bucket at a time, so one buffer per purpose suffices, and large buffers allocated and
        freed every step fragment the CPU heap (measured: RSS grew by 2x the gradient size over 40 steps)."""
        buf = self._ws.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._ws[name] = like.new_empty(numel)
        return buf[:numel]

    def _reduce_scatter(self, tensor: Tensor, group: dist.ProcessGroup, parts: int, out: Tensor | None = None) -> Tensor:
        """Sum of ``tensor`` over ``group``, chunk ``rank in group`` only, into ``out`` (default: a new tensor)."""
        c = tensor.numel() // parts
        if out is None:
            out = tensor.new_empty(c)
        if parts == 1:
            return out.copy_(tensor)
        if self._topo.backend == "nccl":
            collectives.reduce_scatter_single(out, tensor, group=group)
            return out
        # gloo emulates reduce-scatter with a full all-reduce; an all-to-all sends half as much.
        received = self._workspace("all_to_all", tensor.numel(), tensor)
        collectives.all_to_all_single(received, tensor, group=group)
        return torch.sum(received.view(parts, c), dim=0, out=out)

    def _reduce_to_shard(self, bucket: Bucket) -> Tensor:
        """This rank's shard of the bucket's mean. At stage 1 the whole bucket is left holding the mean too, and
        the shard is its slice: what the node reduced is all-gathered inside the node (the hierarchical
        reducer's last stage), and the node's share crosses nodes by an all-reduce (or the codec) instead of a
        reduce-scatter. That costs, per step, one more intra-node all-gather ((k-1)/k of the bucket per rank)
        and, with global shards over several nodes, (M-1)/M of the bucket more per node across nodes (with a
        codec, or node shards, nothing more across nodes). Without hierarchical reduction the bucket is
        all-reduced over the world, as at stage 0."""
        t = self._topo
        layout, k, m = self._layout(), t.ranks_per_node, t.num_nodes
        buf = bucket.buffer
        whole = self.stage == 1
        if layout == "two_level" or (layout == "node" and (m == 1 or self._hierarchical)):
            buf.div_(k)
            if layout == "two_level":
                block = self._reduce_scatter(buf, t.intra_node_group, k, self._workspace("block", buf.numel() // k, buf))
            else:
                block = self._reduce_scatter(buf, t.intra_node_group, k)  # the shard itself
            if layout == "two_level" and not whole and self._plain_cross_node_mean():
                # No codec: reduce-scatter across nodes too, half the bytes of an all-reduce of the block.
                return self._reduce_scatter(block, t.inter_node_group, m).div_(m)
            self._hook.on_cross_node_reduce(tensor=block, group=t.inter_node_group, bucket=bucket).wait()
            if whole:
                if k > 1:
                    collectives.all_gather_single(buf, block, group=t.intra_node_group)
                else:
                    buf.copy_(block)
                return self._slice(buf)
            if layout == "node":
                return block
            c = block.numel() // m
            return block[t.node_rank * c : (t.node_rank + 1) * c].clone()  # not a view keeping the block alive
        if layout == "world" and not whole and self._plain_cross_node_mean():
            return self._reduce_scatter(buf, t.world_group, t.world_size).div_(t.world_size)
        self._hook.on_cross_node_reduce(tensor=buf, group=t.world_group, bucket=bucket).wait()
        return self._slice(buf)

    def _slice(self, flat: Tensor) -> Tensor:
        """This rank's shard of a bucket-sized tensor (a view)."""
        c = flat.numel() // self.num_shards
        return flat[self.shard_index * c : (self.shard_index + 1) * c]

    def _plain_cross_node_mean(self) -> bool:
        """Whether ``on_cross_node_reduce`` would only average (no codec, no plugin of the user's answers it), so
        this rank's shard can come from a reduce-scatter instead of an all-reduce of the whole tensor."""
        if self._plain is None:
            impls = [i for i in self._hook.on_cross_node_reduce.get_hookimpls() if not (i.hookwrapper or i.wrapper)]
            self._plain = all(isinstance(i.plugin, MeanAllReduce) for i in impls)
        return self._plain

    @hookimpl
    def on_bucket_ready(self, bucket: Bucket) -> torch.futures.Future:
        shard = self._reduce_to_shard(bucket)
        entry = self._shards[bucket.index]
        if self.stage == 1:
            entry.grad = shard  # a slice of the bucket, which holds the whole mean
        else:
            if shard.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr():
                shard = shard.clone()
            entry.grad = shard
            bucket.release()
        return completed_future(None)

    def _all_gather(self, full: Tensor, shard: Tensor, async_op: bool = False) -> Any:
        """Gather every rank's ``shard`` into ``full`` (``shard`` must not alias ``full``)."""
        t = self._topo
        layout = self._layout()
        if layout == "node":
            if t.ranks_per_node == 1:
                full.copy_(shard)
                return None
            return (collectives.all_gather_single(full, shard, group=t.side_intra_node_group, async_op=async_op), None)
        if layout == "world":
            return (collectives.all_gather_single(full, shard, group=t.side_world_group, async_op=async_op), None)
        block = full.new_empty(full.numel() // t.ranks_per_node)
        work = collectives.all_gather_single(block, shard, group=t.side_inter_node_group, async_op=async_op)
        if not async_op:
            collectives.all_gather_single(full, block, group=t.side_intra_node_group)
            return None
        return (work, block)

    def _finish_gather(self, full: Tensor, pending: Any) -> None:
        if pending is None:
            return
        work, block = pending
        if work is not None:
            work.wait()
        if block is not None:
            collectives.all_gather_single(full, block, group=self._topo.side_intra_node_group)

    # ------------------------------------------------------------------ backward

    @hookimpl
    def on_after_backward(self, buckets: Sequence[Bucket]) -> None:
        for bucket, entry in zip(self._buckets, self._shards):
            grad, entry.grad = entry.grad, None
            for piece, i, _, s_start in entry.pieces:
                # A parameter no rank used has no gradient, as in one process: its pieces are skipped too.
                piece.grad = grad[s_start : s_start + piece.numel()] if bucket.grad_used[i] else None
            if self.stage > 1:
                for p in bucket.params:
                    p.grad = None  # the optimizer steps the pieces; the module's buckets were released
        # Stage 1: the engine left each used parameter's `.grad` viewing the bucket, which holds the whole mean.
        self._grads_published = self.stage == 1
        if self.stage == 3:
            for unit in self._units:
                if not unit.persistent and unit.gathered:
                    self._free(unit)
            self._order_known = True

    def _register_stage_1_hooks(self) -> None:
        """Stage 1 leaves the module's `.grad` holding the last step's mean, which the optimizer's `zero_grad`
        (it zeroes only this rank's pieces) does not clear. Backward would add the next gradient to it; so the
        first gradient of the next backward (a hook that runs before autograd accumulates it) drops them all,
        and that backward starts from nothing, as after `zero_grad` under DDP. Accumulation inside a
        backward window (`accumulate_grad_batches`) is untouched: nothing is published before it synchronizes."""
        self._grads_published = False

        def discard_published(_grad: Tensor) -> None:
            if self._grads_published:
                self._grads_published = False
                for bucket in self._buckets:
                    for p in bucket.params:
                        p.grad = None

        for bucket in self._buckets:
            for p in bucket.params:
                self._handles.append(p.register_hook(discard_published))

    # ------------------------------------------------------------------ gradients for user hooks

    def _grad_stats(self, norm_type: float | None) -> tuple[Tensor, Tensor]:
        """Per bucket parameter, in bucket order: whether some rank's pieces of it have a gradient, and (with
        ``norm_type``) the sum of ``|g|^norm_type`` over all its pieces, or the max of ``|g|`` for ``inf``.
        Partial values from this rank's pieces, combined over the shard group by one all-reduce."""
        first = [0]
        for bucket in self._buckets:
            first.append(first[-1] + len(bucket.params))
        n = first[-1]
        inf = norm_type == float("inf")
        local = torch.zeros(2 * n, dtype=torch.float64, device=self._topo.device)
        for b, entry in enumerate(self._shards):
            for piece, i, _, _ in entry.pieces:
                if piece.grad is None:
                    continue
                j = first[b] + i
                local[n + j] = 1.0
                if norm_type is not None:
                    g = piece.grad.detach().double().abs()
                    local[j] = torch.maximum(local[j], g.max()) if inf else local[j] + g.pow(norm_type).sum()
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        collectives.all_reduce(local, op=op, group=self._shard_group()[0])
        return local[n:] > 0, local[:n]

    @hookimpl
    def on_gather_full_gradients(self, gather: bool) -> None:
        if self.stage == 1:
            return  # the module's gradients are whole already
        if not gather:
            self._lent_depth = max(self._lent_depth - 1, 0)
            if self._lent_depth == 0:
                for p, previous in self._lent:
                    p.grad = previous
                self._lent = []
            return
        self._lent_depth += 1
        if self._lent_depth > 1:
            return  # nested: lent already (every rank nests alike)
        self._lent = []
        present, _ = self._grad_stats(None)
        j = 0
        for bucket, entry in zip(self._buckets, self._shards):
            flags = present[j : j + len(bucket.params)].tolist()
            j += len(bucket.params)
            if not any(flags):
                continue
            local = entry.shard.new_zeros(entry.shard.numel())
            for piece, _, _, s_start in entry.pieces:
                if piece.grad is not None:
                    local[s_start : s_start + piece.numel()].copy_(piece.grad.detach().reshape(-1))
            # A buffer of its own, not the bucket's: during accumulation the bucket holds this rank's running sum.
            full = local.new_empty(bucket.numel)
            self._all_gather(full, local)
            for i, p in enumerate(bucket.params):
                if flags[i]:
                    self._lent.append((p, p.grad))
                    p.grad = full[bucket.offsets[i] : bucket.offsets[i] + p.numel()].view_as(p)

    @hookimpl
    def on_grad_norms(self, module: nn.Module, norm_type: float) -> dict[str, Tensor] | None:
        if self.stage == 1:
            return None  # `.grad` is whole: Lightning's grad_norm reads it
        inf = norm_type == float("inf")
        present, partial = self._grad_stats(norm_type)
        where: dict[int, int] = {}
        for bucket in self._buckets:
            for p in bucket.params:
                where[id(p)] = len(where)
        norms: dict[str, Tensor] = {}
        for name, p in module.named_parameters():
            j = where.get(id(p))
            if j is None:
                if p.grad is not None:  # not sharded: whole on every rank
                    norms[name] = p.grad.detach().norm(norm_type)
            elif present[j]:
                value = partial[j] if inf else partial[j] ** (1.0 / norm_type)
                norms[name] = value.to(p.dtype)
        return norms

    # ------------------------------------------------------------------ optimizer step

    @hookimpl
    def on_clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        sharded = {id(piece.grad) for entry in self._shards for piece, *_ in entry.pieces if piece.grad is not None}
        device = self._topo.device
        local = torch.zeros((), dtype=torch.float64, device=device)
        replicated = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            sq = g.detach().double().pow(2).sum()
            if id(g) in sharded:
                local += sq
            else:
                replicated += sq  # gradients of parameters that are not sharded are the same on every rank
        group = self._topo.side_intra_node_group if self._layout() == "node" else self._topo.side_world_group
        collectives.all_reduce(local, group=group)
        total = (local + replicated).sqrt().to(torch.float32)
        clip_coef = max_norm / (total + 1e-6)
        clamped = torch.clamp(clip_coef, max=1.0)
        if self.stage == 1:
            # The pieces' gradients are slices of the buckets, and the module's `.grad` views all of them:
            # scale the whole buckets, so that `.grad` shows what the optimizer applies, the same on every rank.
            grads = [g for g in grads if id(g) not in sharded] + [b.buffer for b in self._buckets]
        for g in grads:
            g.mul_(clamped.to(g.dtype))
        return total

    @hookimpl
    def on_after_optimizer_step(self, optimizer: Optimizer) -> None:
        for entry, bucket in zip(self._shards, self._buckets):
            unit = self._unit_of_bucket.get(bucket.index)
            if unit is not None and not unit.persistent:
                if unit.gathered:
                    self._free(unit)  # stale now; gathered again when the next forward needs it
                continue
            self._all_gather(entry.full, entry.shard.clone())

    # ------------------------------------------------------------------ stage 3: gather and free

    def _gathered_now(self) -> int:
        return sum(e.full.untyped_storage().nbytes() for e in self._shards)

    def _free(self, unit: _Unit) -> None:
        entry = self._shards[unit.bucket]
        if unit.pending is not None:
            self._finish_gather(entry.full, unit.pending)
            unit.pending = None
        entry.full.untyped_storage().resize_(0)
        unit.gathered = False

    def _start_gather(self, unit: _Unit, async_op: bool) -> None:
        entry = self._shards[unit.bucket]
        entry.full.untyped_storage().resize_(entry.full.numel() * entry.full.element_size())
        unit.gathered = True
        unit.pending = self._all_gather(entry.full, entry.shard, async_op=async_op)
        if not async_op:
            unit.pending = None
        now = self._gathered_now()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)
        self.fit_peak_gathered_bytes = max(self.fit_peak_gathered_bytes, now)

    def _gather_unit(self, unit: _Unit) -> None:
        if not unit.gathered:
            self._start_gather(unit, async_op=False)
        elif unit.pending is not None:
            self._finish_gather(self._shards[unit.bucket].full, unit.pending)
            unit.pending = None

    def _prefetch(self, unit: _Unit, step: int) -> None:
        if not self._order_known or unit not in self._forward_order:
            return
        i = self._forward_order.index(unit) + step
        if 0 <= i < len(self._forward_order):
            nxt = self._forward_order[i]
            if not nxt.gathered:
                self._start_gather(nxt, async_op=True)

    def _register_unit_hooks(self, unit: _Unit, module: nn.Module) -> None:
        """Hooks on one of the unit's modules (a unit of several siblings gets them on each): the first forward
        of the unit in a pass gathers it, and it is freed once every one of its modules has run (a module that
        runs again later gathers it again)."""
        unit.modules.append(module)

        def pre_forward(_module: nn.Module, _args: Any) -> None:
            if not unit.gathered or not unit.waiting:
                unit.waiting = {id(m) for m in unit.modules}
            self._gather_unit(unit)
            if not self._order_known and unit not in self._forward_order:
                self._forward_order.append(unit)
            if torch.is_grad_enabled():
                self._prefetch(unit, +1)

        def post_forward(_module: nn.Module, _args: Any, output: Any) -> Any:
            unit.waiting.discard(id(_module))
            if not unit.waiting:
                self._free(unit)
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            if tensors and torch.is_grad_enabled():
                unit.remaining = len(self._buckets[unit.bucket].params)

                def pre_backward(_grads: Any) -> None:
                    self._gather_unit(unit)
                    self._prefetch(unit, -1)

                torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")
            return output

        self._handles.append(module.register_forward_pre_hook(pre_forward))
        self._handles.append(module.register_forward_hook(post_forward))

    def _make_grad_done(self, unit: _Unit):
        def grad_done(_p: nn.Parameter) -> None:
            if unit.persistent:
                return
            unit.remaining -= 1
            if unit.remaining == 0 and unit.gathered:
                self._free(unit)

        return grad_done

    @property
    def largest_unit_bytes(self) -> int:
        """Stage 3: bytes of the largest unit's gathered parameters (what forward and backward add to the shards;
        twice that while the next unit is prefetched). The root unit, always gathered, counts too."""
        return max((self._shards[u.bucket].full.numel() * self._shards[u.bucket].full.element_size()
                    for u in self._units), default=0)

    @hookimpl
    def on_gather_full_parameters(self, gather: bool) -> None:
        for unit in self._units:
            if unit.persistent:
                continue
            if gather:
                self._gather_unit(unit)
            elif unit.gathered:
                self._free(unit)

    # ------------------------------------------------------------------ checkpoints: one consolidated layout

    def _shard_group(self) -> tuple[dist.ProcessGroup, list[int]]:
        """The side group one full copy of the shards is spread over, and the shard index of each of its ranks."""
        t = self._topo
        layout = self._layout()
        if layout == "node":
            return t.side_intra_node_group, list(range(t.ranks_per_node))
        if layout == "two_level":
            k, m = t.ranks_per_node, t.num_nodes
            return t.side_world_group, [(r % k) * m + r // k for r in range(t.world_size)]
        return t.side_world_group, list(range(t.world_size))

    def _gather_flat_to_root(self, local: Tensor, group: dist.ProcessGroup, index_of: list[int]) -> Tensor | None:
        """Every rank's shard-sized ``local`` assembled in shard order on the group's first rank (else None),
        received straight into one buffer, in chunks (gloo's gather stages its output in a buffer of its own:
        chunks keep that small)."""
        root = dist.get_global_rank(group, 0)
        if dist.get_rank() != root:
            for a in range(0, local.numel(), _GATHER_CHUNK):
                dist.gather(local[a : a + _GATHER_CHUNK], None, dst=root, group=group)
            return None
        c = local.numel()
        full = local.new_empty(c * len(index_of))
        for a in range(0, c, _GATHER_CHUNK):
            z = min(a + _GATHER_CHUNK, c)
            dist.gather(local[a:z], [full[idx * c + a : idx * c + z] for idx in index_of], dst=root, group=group)
        return full

    def _gather_state_entry(self, optimizer: Optimizer, b: int, k: str, group: dist.ProcessGroup,
                            index_of: list[int]) -> Tensor | None:
        """Optimizer state entry ``k`` of bucket ``b``, flat and whole, on global rank 0 (None elsewhere): the
        producer of a deferred checkpoint tensor."""
        entry = self._shards[b]
        buf = torch.zeros_like(entry.shard)
        for piece, _, _, s_start in entry.pieces:
            v = optimizer.state.get(piece, {}).get(k)
            if v is not None:
                buf[s_start : s_start + piece.numel()].copy_(v.reshape(-1))
        return self._gather_flat_to_root(buf, group, index_of)

    def _unsharded_numbering(self, optimizer: Optimizer) -> tuple[list[tuple[int, nn.Parameter]], list[dict[str, Any]]]:
        """The user's parameters numbered across groups as an unsharded ``optimizer.state_dict()`` numbers
        them, and its ``param_groups`` (hyperparameters, and those numbers as ``params``)."""
        numbered: list[tuple[int, nn.Parameter]] = []
        groups = []
        for group_dict, params in zip(optimizer.param_groups, self._original_groups[id(optimizer)]):
            ids = list(range(len(numbered), len(numbered) + len(params)))
            numbered.extend(zip(ids, params))
            groups.append({**{k: v for k, v in group_dict.items() if k != "params"}, "params": ids})
        return numbered, groups

    def _piece_starts(self) -> dict[int, int]:
        """``id(piece)`` -> the element of its parameter (flattened) where this rank's piece starts."""
        return {id(piece): p_start for entry in self._shards for piece, _, p_start, _ in entry.pieces}

    @hookimpl
    def on_optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any] | None:
        """Gather the sharded optimizer state to global rank 0 in the layout the unsharded optimizer would have
        (``{"state": {index: {...}}, "param_groups": [...]}``, parameters numbered across groups in order). The
        sharded entries are :class:`DeferredTensor`\\ s, gathered one bucket and one entry at a time while rank 0
        writes the file; every rank whose shards rank 0 needs returns the same structure (its producers send),
        the ranks of other nodes (node scope) return ``{}`` at once."""
        if id(optimizer) not in self._original_groups:
            return None  # not an optimizer this sharder set up
        group, index_of = self._shard_group()
        if dist.get_global_rank(group, 0) != 0:
            return {}  # a node other than rank 0's (node scope): nothing of it is written, nothing to gather
        # What exists where: per bucket and parameter, the state entries of this rank's pieces.
        local: dict[tuple[int, int], dict[str, Any]] = {}
        for b, entry in enumerate(self._shards):
            for piece, i, _, _ in entry.pieces:
                st = optimizer.state.get(piece)
                if st:
                    local[(b, i)] = {
                        k: ("flat" if isinstance(v, Tensor) and v.dim() > 0 and v.numel() == piece.numel() else v)
                        for k, v in st.items()
                    }
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
        meta: dict[tuple[int, int], dict[str, Any]] = {}
        for part in everyone:
            for key, entries in part.items():
                meta.setdefault(key, {}).update(entries)

        full_state: dict[tuple[int, int], dict[str, Any]] = {key: {} for key in meta}
        for b, (bucket, entry) in enumerate(zip(self._buckets, self._shards)):
            flat_keys = sorted({k for (bb, _), e in meta.items() if bb == b for k, v in e.items() if v == "flat"})
            for k in flat_keys:
                # Deferred: gathered when the checkpoint is written, one bucket's entry at a time, so rank 0
                # holds one bucket of optimizer state beside what it writes, not the whole state.
                storage = DeferredStorage(
                    dtype=entry.shard.dtype, numel=entry.shard.numel() * len(index_of), device=str(entry.shard.device),
                    produce=functools.partial(self._gather_state_entry, optimizer, b, k, group, index_of),
                )
                for (bb, i), e in meta.items():
                    if bb == b and e.get(k) == "flat":
                        p = bucket.params[i]
                        full_state[(b, i)][k] = DeferredTensor(storage, bucket.offsets[i], tuple(p.shape))
            for (bb, i), e in meta.items():
                if bb == b:
                    for k, v in e.items():
                        if v != "flat":
                            full_state[(b, i)][k] = v
        where = {id(p): (b, i) for b, bucket in enumerate(self._buckets) for i, p in enumerate(bucket.params)}
        state: dict[int, dict[str, Any]] = {}
        numbered, groups = self._unsharded_numbering(optimizer)
        for index, p in numbered:
            if id(p) in where:
                st = full_state.get(where[id(p)])
                if st:
                    state[index] = st
            elif optimizer.state.get(p):
                state[index] = optimizer.state[p]  # not sharded: the same on every rank
        return {"state": state, "param_groups": groups}

    @hookimpl
    def on_load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: Mapping[str, Any]) -> bool:
        """Take this rank's pieces of an unsharded optimizer state dict (any world size, stage or scope wrote it)."""
        originals = self._original_groups[id(optimizer)]
        saved_groups = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in saved_groups] != [len(ps) for ps in originals]:
            raise ValueError(
                "The checkpoint's optimizer state does not fit this model's optimizer: it has parameter groups of"
                f" {[len(g['params']) for g in saved_groups]} parameters, the optimizer of"
                f" {[len(ps) for ps in originals]}. Was it saved from another model or `configure_optimizers`?"
            )
        where = self._piece_starts()
        saved_state = state_dict.get("state", {})
        optimizer.state.clear()
        for group_dict, params, saved in zip(optimizer.param_groups, originals, saved_groups):
            group_dict.update({k: v for k, v in saved.items() if k != "params"})
            for p, index in zip(params, saved["params"]):
                st = saved_state.get(index)
                if not st:
                    continue
                for k, v in st.items():
                    if isinstance(v, Tensor) and v.dim() > 0 and v.shape != p.shape:
                        raise ValueError(
                            f"The checkpoint's optimizer state `{k}` has shape {tuple(v.shape)} for a parameter of"
                            f" shape {tuple(p.shape)}: it was saved from another model."
                        )
                pieces = self._pieces_of.get(id(p))
                if pieces is None:
                    optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, Tensor) else v) for k, v in st.items()}
                    continue
                for piece in pieces:
                    start = where[id(piece)]
                    optimizer.state[piece] = {
                        k: (v.detach().reshape(-1)[start : start + piece.numel()].to(piece.device, copy=True)
                            if isinstance(v, Tensor) and v.dim() > 0 else
                            (v.to(piece.device, copy=True) if isinstance(v, Tensor) else v))
                        for k, v in st.items()
                    }
        return True

    @hookimpl
    def on_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The module's full state dict on global rank 0 (at stage 3 gathered one unit at a time and copied, so
        rank 0 holds the full model plus one unit; at stages 1-2 the parameters themselves); ``{}`` elsewhere."""
        me = dist.get_rank()
        names: dict[int, list[str]] = {}
        for name, value in module.state_dict(keep_vars=True).items():
            names.setdefault(id(value), []).append(name)
        copies: dict[str, Tensor] = {}
        for bucket in self._buckets:
            unit = self._unit_of_bucket.get(bucket.index)
            gathered_here = unit is not None and not unit.gathered
            if gathered_here:
                self._gather_unit(unit)
            if me == 0:
                for p in bucket.params:
                    # A unit gathered only for this is freed below: copy it. Otherwise the parameter is whole
                    # and stays so while the checkpoint is written (no copy: ~S less on rank 0).
                    value = p.detach().clone() if gathered_here else p.detach()
                    for name in names.get(id(p), []):
                        copies[name] = value
            if gathered_here:
                self._free(unit)
        if me != 0:
            return {}
        return {name: copies.get(name, value.detach()) for name, value in module.state_dict(keep_vars=True).items()}

    def _refuse_unsharded_access(self, optimizer: Optimizer) -> None:
        """The optimizer holds this rank's pieces from now on, during `fit` and after it: its own ``state_dict()``
        would silently be this rank's part only (and ``load_state_dict`` would pour a whole state into pieces).
        Both raise instead, pointing to the strategy's consolidating save and load."""
        name, stage = type(optimizer).__name__, self.stage

        def refuse(_optimizer: Optimizer, *_args: Any) -> None:
            raise RuntimeError(
                f"This {name}'s parameters and state are sharded over the ranks by ZeRO stage {stage} (each rank"
                " steps 1-D pieces of its shard), so its own state_dict()/load_state_dict() would see this rank's"
                " pieces only. Save and load it through Lightning, on every rank: `trainer.save_checkpoint(path)`"
                " writes its state consolidated (the layout it has unsharded), also after `fit`, and"
                " `trainer.fit(model, ckpt_path=path)` loads it."
            )

        optimizer.register_state_dict_pre_hook(refuse)
        optimizer.register_load_state_dict_pre_hook(refuse)

    # ------------------------------------------------------------------ checkpoints: this rank's part only

    @hookimpl
    def on_local_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """This rank's part of the module state, for ``checkpoint="sharded"``: at stage 3 the pieces of the
        sharded parameters as ``<name>#<start>`` (the slice of the flattened parameter from element ``start``),
        everything else whole (every rank holds it; written once)."""
        whole = module.state_dict(keep_vars=True)
        out: dict[str, Tensor] = {}
        sharded: set[str] = set()
        if self.stage == 3:
            names: dict[int, list[str]] = {}
            for name, value in whole.items():
                names.setdefault(id(value), []).append(name)
            for bucket, entry in zip(self._buckets, self._shards):
                unit = self._unit_of_bucket.get(bucket.index)
                if unit is None or unit.persistent or unit.gathered:
                    continue
                for p in bucket.params:  # freed here: only this rank's pieces (if any) are valid
                    sharded.update(names.get(id(p), []))
                for piece, i, p_start, _ in entry.pieces:
                    for name in names.get(id(bucket.params[i]), []):
                        out[f"{name}#{p_start}"] = piece.detach()
        out.update({name: value.detach() for name, value in whole.items() if name not in sharded})
        return out

    @hookimpl
    def on_local_optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any] | None:
        """This rank's part of ``optimizer``'s state, for ``checkpoint="sharded"``: ``{"state": {flat key:
        value}, "param_groups": [...], "shapes": {...}}`` with the parameters numbered as in an unsharded
        ``optimizer.state_dict()``; a sharded state tensor is ``<index>/<key>#<start>``, the rest
        ``<index>/<key>``."""
        if id(optimizer) not in self._original_groups:
            return None  # not an optimizer this sharder set up
        where = self._piece_starts()
        sharded = {id(p) for bucket in self._buckets for p in bucket.params}
        state: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        numbered, groups = self._unsharded_numbering(optimizer)
        for index, p in numbered:
            if id(p) in sharded:
                # Every sharded parameter's shape, on every rank: rank 0 writes the metadata, and it may hold no
                # piece of this parameter (its state is then in other ranks' files only).
                shapes[f"{index}"] = tuple(p.shape)
            pieces = self._pieces_of.get(id(p))
            if pieces is None:
                if id(p) not in sharded:
                    for k, v in optimizer.state.get(p, {}).items():
                        state[f"{index}/{k}"] = v
                continue
            for piece in pieces:
                for k, v in optimizer.state.get(piece, {}).items():
                    if isinstance(v, Tensor) and v.dim() > 0 and v.numel() == piece.numel():
                        state[f"{index}/{k}#{where[id(piece)]}"] = v
                    else:
                        state[f"{index}/{k}"] = v  # the same on every rank (e.g. Adam's step)
        return {"state": state, "param_groups": groups, "shapes": shapes}

    # ------------------------------------------------------------------ metrics

    @hookimpl
    def on_collect_metrics(self) -> dict[str, float]:
        if self.stage != 3:
            return {}
        peak, self.peak_gathered_bytes = self.peak_gathered_bytes, self._gathered_now()
        return {"zero/gathered_peak_MB": peak / 1e6}
