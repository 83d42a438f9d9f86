"""``OuterSync``: synchronizing nodes every ``sync_every`` optimizer steps instead of every step (local SGD,
DiLoCo, Streaming DiLoCo), as a plugin on the hook contract.

Inside a node the ranks stay synchronous: gradient buckets are averaged over the node only (nothing crosses
nodes): at stage 0 this plugin all-reduces them over the node itself (``on_bucket_ready``), at ZeRO stages 1-3
the sharder reduces them to its node-scope shards and this plugin answers ``on_cross_node_reduce`` with nothing
to do. Every rank of a node gets the node's mean gradient, and a node is one replica.

Across nodes, after the optimizer steps the schedule names (:class:`~ddp_plugin.sync.schedule.SyncSchedule`),
a fragment of the parameters is synchronized:

1. sent (after step ``t``): this rank's part of the fragment, ``s`` (the ranks of a node split every bucket's
   flat parameters into k parts: the sharder's shards at ZeRO stages 1-3, else chunks of its own); the outer
   optimizer ("average": SGD with lr 1, so the global copy ``x`` becomes the mean of the replicas; "nesterov":
   SGD with Nesterov momentum, DiLoCo) steps ``x`` with the mean over the nodes of the pseudo-gradient
   ``g = x - s`` as its gradient. With a codec (any plugin answering ``on_cross_node_reduce`` ahead of the plain
   mean), ``x`` and the outer state are kept for this rank's whole part and ``g`` is averaged over the ranks with
   this local rank on every node through ``on_cross_node_reduce``, so the codec compresses it (error feedback
   per fragment and bucket: ``Bucket.kind == "pseudo_gradient"``). With the plain mean they are sharded over
   those ranks too (1/n of the part each, 2S/N per rank for DiLoCo instead of 2S/k): ``s`` is reduce-scattered,
   the rank steps its share with ``x - mean(s)``, and the stepped shares are all-gathered back (the bytes of
   the all-reduce of ``g``). With staleness this runs on a thread of its own over process groups of its own,
   behind the next inner steps; without, the training thread would wait for it anyway, and with the plain mean
   runs it itself, in windows of a rank's part (``WINDOW_BYTES``);
2. applied (after step ``t + max_staleness``): the replica's part becomes ``now + (x - s)``: the global copy
   plus the inner progress made while the average was in flight (none with ``max_staleness=0``, where the
   replica becomes ``x`` itself and every rank then holds the same bits). At stage 0 each rank then broadcasts
   its part into the other ranks' of the node (at stages 1-3 the sharder's after-step all-gather spreads it).

Each rank sends 2(M-1)/M of its part of a fragment per sync: per node, S/F every H/F steps, S/H per step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin import health
from ddp_plugin.clock import Clock, Intervals
from ddp_plugin.streams import SideStream, SideThread
from ddp_plugin.comm import RS_PIECE_BYTES, gather_flat_to_root
from ddp_plugin.hookspecs import (
    DeferredStorage,
    DeferredTensor,
    as_parameter_layout,
    completed_future,
    hookimpl,
    is_tensor_parallel_shard,
    local_part_of_whole,
    local_tensor,
)
from ddp_plugin.sync.schedule import SyncSchedule, fragment_bounds

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch.optim import Optimizer

    from ddp_plugin.hookspecs import Bucket, Communicator, Options, ParameterShards, Topology

log = logging.getLogger(__name__)

NESTEROV = {"lr": 0.7, "momentum": 0.9}
"""DiLoCo's outer optimizer (Douillard et al., 2023): SGD with Nesterov momentum."""
STATE_KEY = "sync/outer"


WINDOW_BYTES = RS_PIECE_BYTES
"""A sync without staleness (outer state sharded over the nodes) reads and reduces each rank's part this much at a
time (the n shares' windows together)."""

OUTER_SYNC = "the outer (cross-node) sync"
"""What a failed sync's error says failed."""


def build_outer_optimizer(spec: Any, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if spec == "average":
        return torch.optim.SGD(params, lr=1.0)
    if spec == "nesterov":
        return NesterovSGD(params, lr=NESTEROV["lr"], momentum=NESTEROV["momentum"], nesterov=True)
    optimizer = spec(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"`outer_optimizer` must return a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    return optimizer


class NesterovSGD(torch.optim.SGD):
    """``torch.optim.SGD`` with Nesterov momentum (no weight decay, no dampening), computed as torch computes it,
    the same bits, but with the Nesterov term added into the gradient's own memory: torch's ``grad.add(buf,
    alpha=momentum)`` allocates a tensor of the gradient's size per step (at a DiLoCo sync, S/k per rank). The
    gradients are pseudo-gradients this plugin made for the step, and are consumed by it."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("the outer optimizer takes no closure")
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    buf.mul_(momentum).add_(grad)
                grad.add_(buf, alpha=momentum)
                p.add_(grad, alpha=-lr)


@dataclasses.dataclass(eq=False)
class Piece:
    """The part of fragment ``fragment`` in bucket ``bucket`` that this rank synchronizes: elements
    ``[lo, hi)`` of the bucket's flat parameters."""

    fragment: int
    bucket: int
    lo: int
    hi: int
    outer: nn.Parameter  # the global copy of elements [own_lo, own_hi)
    pseudo: Bucket  # what the codec sees: the bucket's layout, kind "pseudo_gradient", its own index
    own_lo: int  # the elements whose global copy (and outer optimizer state) this rank keeps: [lo, hi) itself,
    own_hi: int  # or with the outer state sharded over the nodes, this node's 1/n of it
    width: int  # with the outer state sharded, each node's share of [lo, hi) (the last one padded to it)


@dataclasses.dataclass
class InFlight:
    """A fragment sent and not applied yet: its snapshot ``s`` per piece and the future of its updates (the
    outer thread's ``(updates, drift)``)."""

    fragment: int
    apply_after: int
    snapshots: list[Tensor]
    result: concurrent.futures.Future


@dataclasses.dataclass
class Update:
    """Elements ``[lo, hi)`` of bucket ``bucket``'s flat parameters: ``values`` to write, or to add."""

    bucket: int
    lo: int
    hi: int
    values: Tensor


class ModuleChunks:
    """The parameter parts of ZeRO stage 0, where the module's parameters are whole on every rank: the ranks of a
    node split each bucket's flat parameters into k chunks (local rank l owns chunk l), read from and written to
    the module; :meth:`publish` broadcasts ranges of them inside the node."""

    def __init__(self, buckets: Sequence[Bucket], topology: Topology, comm: Communicator) -> None:
        self.buckets, self.topology, self.comm = list(buckets), topology, comm
        k, l = topology.ranks_per_node, topology.local_rank
        self.chunk = [-(-b.numel // k) for b in self.buckets]
        self.parts = [(l * c, min((l + 1) * c, b.numel)) for b, c in zip(self.buckets, self.chunk)]

    def _slices(self, b: int, lo: int, hi: int):
        bucket = self.buckets[b]
        for i, p in enumerate(bucket.params):
            p = local_tensor(p)  # (a tensor-parallel parameter's local shard)
            a, z = max(lo, bucket.offsets[i]), min(hi, bucket.offsets[i] + p.numel())
            if a < z:
                yield p, a - bucket.offsets[i], z - bucket.offsets[i], a - lo

    def read(self, b: int, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.zeros(hi - lo, dtype=self.buckets[b].buffer.dtype, device=self.topology.device)
        else:
            out.zero_()
        for p, a, z, at in self._slices(b, lo, hi):
            out[at : at + z - a].copy_(p.detach().reshape(-1)[a:z])
        return out

    def write(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        with torch.no_grad():
            for p, a, z, at in self._slices(b, lo, hi):
                p.view(-1)[a:z].copy_(values[at : at + z - a])

    def add(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        with torch.no_grad():
            for p, a, z, at in self._slices(b, lo, hi):
                p.view(-1)[a:z].add_(values[at : at + z - a])

    def _spans(self, b: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Each local rank's part of ``[lo, hi)`` in bucket ``b`` (its chunk's intersection; empty ones at lo)."""
        c = self.chunk[b]
        return [(max(lo, l * c), max(max(lo, l * c), min(hi, (l + 1) * c))) for l in range(self.topology.ranks_per_node)]

    def publish(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        """Every rank of the node gets the elements ``[lo, hi)`` of bucket ``b`` (for each ``(b, lo, hi)``) from
        the ranks whose chunks hold them (on the training thread's side group): each rank's part broadcast from
        its parameters straight into the others', one parameter's slice at a time, so no buffer of a range's
        size is allocated (a DiLoCo sync publishes whole buckets)."""
        t = self.topology
        if t.ranks_per_node == 1:
            return
        for b, lo, hi in ranges:
            for l, (a, z) in enumerate(self._spans(b, lo, hi)):
                for p, pa, pz, _ in self._slices(b, a, z):
                    self.comm.broadcast(p.detach().view(-1)[pa:pz], src=l, group=t.side_intra_node_group)


class ShardParts:
    """The parameter parts of ZeRO stages 1-3 at node scope: the sharder's shards, written in place."""

    def __init__(self, shards: ParameterShards) -> None:
        self.shards = shards
        self.parts = [(offset, offset + part.numel()) for _, offset, part in shards.parts]

    def read(self, b: int, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        _, offset, part = self.shards.parts[b]
        if out is None:
            return part[lo - offset : hi - offset].clone()
        return out.copy_(part[lo - offset : hi - offset])

    def write(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        _, offset, part = self.shards.parts[b]
        part[lo - offset : hi - offset].copy_(values)

    def add(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        _, offset, part = self.shards.parts[b]
        part[lo - offset : hi - offset].add_(values)

    def publish(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        self.shards.publish()


class OuterSync:
    """Cross-node synchronization every ``every`` optimizer steps (see the module docstring)."""

    def __init__(self, every: int, outer_optimizer: Any = "nesterov", fragments: int = 1, staleness: int = 0,
                 warmup: int = 0) -> None:
        self.schedule = SyncSchedule(every, fragments, staleness)
        self.warmup = warmup  # synchronous steps first (post-local SGD): the sync mode starts after step `warmup`
        self.outer_spec = outer_optimizer
        self.step = 0
        self.pieces: list[Piece] = []
        self.in_flight: list[InFlight] = []
        self.outer: torch.optim.Optimizer | None = None
        self.syncs = 0
        self._syncs_logged = 0
        self._wait_s = 0.0
        self._clock = Clock(torch.device("cpu"))
        self._waits = Intervals(self._clock)
        """The training thread's waits for syncs, as stamps of its stream (CUDA events: read once passed)."""
        self._side = SideStream(torch.device("cpu"))
        """The outer thread's CUDA stream (see ddp_plugin.streams)."""
        self._drift: list[float] = []
        self._pending_state: tuple[Mapping[str, Any], Mapping[str, Any] | None] | None = None
        self._thread: SideThread | None = None
        self.access: ShardParts | ModuleChunks | None = None
        self.optimizers: list[Optimizer] = []
        self._inner_pending: list[Any] | None = None

    # ------------------------------------------------------------------ setup

    @hookimpl(trylast=True)  # after the sharder's own setup, so its shards exist to be asked for
    def on_setup(self, topology: Topology, buckets: Sequence[Bucket], hook: HookRelay, options: Options,
                 module: nn.Module, comm: Communicator) -> None:
        self.topology, self.hook, self.comm = topology, hook, comm
        self.buckets = list(buckets)
        t = topology
        k, m = t.ranks_per_node, t.num_nodes
        # Groups of this plugin's own, for the outer thread: collectives on one group must be issued in one
        # order, and the training and communication threads use the topology's.
        self.inter = self.intra = None
        # (every tensor-parallel position's and pipeline stage's: creating one is collective)
        for pp, tp in [(pp, tp) for pp in range(t.pipeline_parallel_size) for tp in range(t.tensor_parallel_size)]:
            mine = tp == t.tensor_parallel_rank and pp == t.pipeline_parallel_rank
            for l in range(k):
                g = comm.new_group([t.global_rank(n * k + l, tp, pp) for n in range(m)])
                if l == t.local_rank and mine:
                    self.inter = g
            for n in range(m):
                g = comm.new_group([t.global_rank(n * k + l, tp, pp) for l in range(k)])
                if n == t.node_rank and mine:
                    self.intra = g
        shards = hook.on_parameter_shards()
        self.access = ShardParts(shards) if shards is not None else ModuleChunks(self.buckets, t, comm)
        # With the plain mean across nodes (no codec answers for the pseudo-gradients) the global copy and the
        # outer optimizer's state are sharded over the nodes too: 1/N of them per rank instead of 1/k.
        self.sharded_outer = m > 1 and _plain_mean(hook, self)
        sizes = [local_tensor(p).numel() for b in self.buckets for p in b.params]
        if self.schedule.fragments > len(sizes):
            raise ValueError(
                f"`sync_fragments={self.schedule.fragments}` is more than the {len(sizes)} trainable parameters"
                " of this model: a fragment smaller than a parameter only adds collectives. Use at most that many"
                " fragments."
            )
        # The parameters' elements of each bucket (its buffer may be padded at the end, to split evenly).
        used = [b.offsets[-1] + local_tensor(b.params[-1]).numel() for b in self.buckets]
        bounds = fragment_bounds(sum(used), self.schedule.fragments)
        self.pieces = []
        # (bucket, start, end) of every fragment's elements in each bucket: the same on every rank, whatever its
        # parts hold.
        self.fragment_ranges: dict[int, list[tuple[int, int, int]]] = {}
        start = 0  # of the bucket in the flat parameters
        for b, bucket in enumerate(self.buckets):
            part_lo, part_hi = self.access.parts[b]
            for f in range(self.schedule.fragments):
                lo, hi = max(bounds[f] - start, 0), min(bounds[f + 1] - start, used[b])
                if lo >= hi:
                    continue
                self.fragment_ranges.setdefault(f, []).append((b, lo, hi))
                lo, hi = max(lo, part_lo), min(hi, part_hi)
                if lo >= hi:
                    continue
                width, own_lo, own_hi = hi - lo, lo, hi
                if self.sharded_outer:
                    width = -(-(hi - lo) // m)
                    own_lo, own_hi = min(lo + t.node_rank * width, hi), min(lo + (t.node_rank + 1) * width, hi)
                outer = nn.Parameter(self.access.read(b, own_lo, own_hi), requires_grad=False)
                pseudo = dataclasses.replace(bucket, index=f * len(self.buckets) + b, kind="pseudo_gradient",
                                             state={}, grad_used=[])
                self.pieces.append(Piece(f, b, lo, hi, outer, pseudo, own_lo, own_hi, width))
            start += used[b]
        self.outer = build_outer_optimizer(self.outer_spec, [p.outer for p in self.pieces])
        self.state_kinds, self.state_kinds_example = _state_kinds(self.outer_spec)
        self._clock = Clock(t.device)
        self._waits = Intervals(self._clock)
        self._thread = SideThread(t.device, "ddp_plugin-outer")
        self._side = self._thread.side
        if self._pending_state is not None:
            self._restore(*self._pending_state)
            self._pending_state = None

    @hookimpl
    def on_setup_optimizer(self, optimizer: Optimizer) -> None:
        self.optimizers.append(optimizer)

    @hookimpl
    def on_teardown(self, failed: bool) -> None:
        # The fit ends: a sync in flight is applied now rather than lost, so the model is the run's last word;
        # after a failure it is dropped (its collectives may wait on a rank that is gone).
        if failed:
            self.in_flight.clear()
            if self._thread is not None:
                self._thread.close(wait=False)
                self._thread = None
            return
        try:
            applied = bool(self.in_flight)
            for flight in list(self.in_flight):
                self._apply(flight)
            if applied and not self.spreads:
                self.access.publish([])  # the sharder's own gather of the last step has run already
        except Exception as err:  # noqa: BLE001 - after a failed run; the original error is what matters
            log.warning("ddp_plugin: could not apply the outer syncs in flight at the end of fit: %s", err)
        finally:
            if self._thread is not None:
                self._thread.close()
                self._thread = None

    @property
    def spreads(self) -> bool:
        """Stage 0: this plugin spreads what it writes over the ranks of the node (at stages 1-3 the sharder's
        after-step all-gather does)."""
        return isinstance(self.access, ModuleChunks)

    # ------------------------------------------------------------------ gradients: inside the node only

    @property
    def synchronous(self) -> bool:
        """Whether the step under way is one of the first ``warmup`` steps, whose gradients cross nodes."""
        return self.step < self.warmup

    @hookimpl
    def on_gradient_scope(self) -> str | None:
        # Between syncs a node is a replica of its own: the step's bookkeeping stays inside it too, so that
        # nothing crosses nodes but the outer syncs.
        return None if self.synchronous else "node"

    @hookimpl(tryfirst=True)
    def on_bucket_ready(self, bucket: Bucket) -> torch.futures.Future | None:
        if not self.spreads or bucket.kind != "gradients" or self.synchronous:
            return None  # ZeRO stages 1-3: the sharder reduces to its node-scope shards; or a synchronous step
        # Stage 0: the node's mean of the whole bucket in one all-reduce. The reducers' reduce-scatter and
        # all-gather exist to cross nodes with 1/k of the bucket; with nothing crossing they only cost (measured
        # on gloo, 2 x 2 ranks, 46 MB: 87 ms against 148 ms).
        t = self.topology
        if t.ranks_per_node == 1:
            return completed_future(bucket.buffer)
        bucket.buffer.div_(t.ranks_per_node)
        # (in pieces: gloo allocates half of what it all-reduces, half a piece then instead of half a bucket)
        return self.comm.all_reduce(bucket.buffer, group=t.intra_node_group, async_op=True,
                                    piece_bytes=RS_PIECE_BYTES).get_future()

    @hookimpl(tryfirst=True)
    def on_cross_node_reduce(self, tensor: Tensor, group: dist.ProcessGroup, bucket: Bucket
                             ) -> torch.futures.Future | None:
        if bucket.kind != "gradients" or self.synchronous:
            # A pseudo-gradient of ours, or a gradient of a synchronous step: the codec (or the plain mean)
            # averages it across nodes.
            return None
        t = self.topology
        if group is t.world_group and t.ranks_per_node > 1:
            # The flat path (hierarchical=False): the node's mean instead of the world's.
            tensor.div_(t.ranks_per_node)
            self.comm.all_reduce(tensor, group=t.intra_node_group, piece_bytes=RS_PIECE_BYTES)
        return completed_future(tensor)  # across nodes: nothing, this step

    # ------------------------------------------------------------------ the outer step

    @hookimpl(tryfirst=True)
    def on_after_optimizer_step(self, optimizer: Optimizer) -> None:
        # tryfirst: the sharder's own after-step gather (later) then spreads what is written here.
        self.step += 1
        if self.step <= self.warmup:
            if self.step == self.warmup:
                # The synchronous steps are over, every rank holds the same bits: the global copy starts here.
                with torch.no_grad():
                    for piece in self.pieces:
                        piece.outer.copy_(self.access.read(piece.bucket, piece.own_lo, piece.own_hi))
            return
        # The syncs sent earlier are applied first, then this step's sent (and applied now without staleness):
        # fragments are disjoint, so the order changes no value, and the buffers of the syncs applied are free
        # before the next one's are allocated.
        self._apply_due()
        for f in self.schedule.sent_after(self.step - self.warmup):
            self._send(f)
        self._apply_due()  # (without staleness: the syncs just sent)

    def _apply_due(self) -> None:
        for flight in [x for x in self.in_flight if x.apply_after == self.step]:
            self._apply(flight)

    def _send(self, fragment: int) -> None:
        pieces = self._pieces_of(fragment)
        if self.sharded_outer and not self.schedule.staleness:
            self._sync_now(fragment, pieces)
            return
        if self.sharded_outer:
            # Every buffer the outer step works in is allocated here, on the training thread, which frees them
            # once the sync is applied (the outer thread's own heap stays small); the snapshots are what is
            # reduced, each padded to n equal shares.
            padded = [self._read_padded(p) for p in pieces]
            snapshots = [x[: p.hi - p.lo] for p, x in zip(pieces, padded)]
            shares = [torch.empty(p.width, dtype=x.dtype, device=x.device) for p, x in zip(pieces, padded)]
            gathered = [torch.empty_like(x) for x in padded]
            result = self._thread.submit(self._on_side, self._side.hand_over(), self._outer_step_sharded, pieces,
                                         padded, shares, gathered)
        else:
            snapshots = [self.access.read(p.bucket, p.lo, p.hi) for p in pieces]
            if self.schedule.staleness:
                pseudo = [p.outer.detach() - s for p, s in zip(pieces, snapshots)]
            else:
                # Without staleness the snapshots serve only here (a sync is applied in the step that sent it, so
                # none is in flight when a checkpoint saves them): the pseudo-gradients take their memory.
                pseudo = [torch.sub(p.outer.detach(), s, out=s) for p, s in zip(pieces, snapshots)]
                snapshots = None
            result = self._thread.submit(self._on_side, self._side.hand_over(), self._outer_step, pieces, pseudo,
                                         snapshots)
        self.in_flight.append(InFlight(fragment, self.step + self.schedule.staleness,
                                       snapshots or [None] * len(pieces), result))

    def _on_side(self, ready: torch.cuda.Event | None, step: Callable[..., Any], *args: Any) -> Any:
        """``step(*args)`` on the outer thread, its stream past what the training thread queued before the send.
        (The tensors it uses stay referenced by the sync in flight until the training stream has waited for the
        outer one, in _apply: their memory is not reused meanwhile.)"""
        self._side.receive(ready)
        return step(*args)

    def _read_padded(self, piece: Piece) -> Tensor:
        """The replica's values of the piece, padded to n shares of ``width`` (zeros past its end)."""
        buf = torch.empty(piece.width * self.topology.num_nodes, dtype=piece.outer.dtype, device=self.topology.device)
        self._read_into(piece.bucket, piece.lo, piece.hi, buf)
        return buf

    def _outer_gradient(self, piece: Piece, share: Tensor) -> Tensor:
        """This rank's share of the replicas' sum over the nodes (``share``, reduce-scattered over them) turned, in
        its own memory, into the outer gradient of the share: ``x - mean(s)``."""
        g = share[: piece.own_hi - piece.own_lo].div_(self.topology.num_nodes)
        return torch.sub(piece.outer.detach(), g, out=g)

    def _windows(self, piece: Piece, window: int):
        """The piece's part in windows: for each offset ``q`` into the n shares, ``(q, size, spans)`` with
        ``spans[j] = (a, z)``, the replica's elements ``[a, z)`` of share j's window (empty past the part's end)."""
        n, w = self.topology.num_nodes, piece.width
        for q in range(0, w, window):
            size = min(window, w - q)
            spans = [(min(piece.lo + j * w + q, piece.hi), min(piece.lo + j * w + q + size, piece.hi))
                     for j in range(n)]
            yield q, size, spans

    def _read_into(self, b: int, a: int, z: int, out: Tensor) -> None:
        """The replica's elements ``[a, z)`` of bucket ``b`` into ``out``, zeros past them."""
        if z > a:
            self.access.read(b, a, z, out=out[: z - a])
        out[max(z - a, 0) :].zero_()

    def _sync_now(self, fragment: int, pieces: list[Piece]) -> None:
        """A sync without staleness, with the outer state sharded over the nodes, on the training thread (which
        would wait for it anyway), in windows of at most ``WINDOW_BYTES`` of each piece's part: each window's
        shares reduce-scattered over the nodes (the same sums as the whole part's, element by element), one
        outer step, then each window's stepped shares broadcast from the nodes that keep them, written into the
        replica (the node's drift counted on the way), and each bucket's range spread inside the node. At the
        peak: this rank's shares of the mean (S/N) and a window, instead of a bucket's part."""
        started = self._clock.stamp()
        t = self.topology
        n = t.num_nodes
        window = max(1, WINDOW_BYTES // (n * 4))  # elements of a share per window (fp32: a buffer of 4 MiB)
        mine = {p.bucket: p for p in pieces}
        with health.diagnosed(OUTER_SYNC):
            grads = []
            for piece in pieces:
                share = torch.empty(piece.width, dtype=piece.outer.dtype, device=t.device)
                buf = torch.empty(n * min(window, piece.width), dtype=share.dtype, device=t.device)
                for q, size, spans in self._windows(piece, window):
                    win = buf[: n * size]
                    for j, (a, z) in enumerate(spans):
                        self._read_into(piece.bucket, a, z, win[j * size : (j + 1) * size])
                    self.comm.reduce_scatter(share[q : q + size], win, group=self.inter)
                grads.append(self._outer_gradient(piece, share))
                del share, buf
            self._outer_optimizer_step(pieces, grads)
            del grads  # (their memory is free again)
            drift = torch.zeros((), dtype=torch.float64, device=t.device)
            for b, lo, hi in self.fragment_ranges[fragment]:
                piece = mine.get(b)
                if piece is not None:
                    drift += self._take_global_copy(piece, window)
                if self.spreads:
                    self.access.publish([(b, lo, hi)])
            if t.ranks_per_node > 1:
                self.comm.all_reduce(drift, group=t.side_intra_node_group)
        self.comm.release_scratch()  # the reduce-scatter's piece: syncs are `sync_every` steps apart
        self._waits.add(started, self._clock.stamp())
        self.syncs += 1
        self._drift.append(float(drift.sqrt()))

    def _take_global_copy(self, piece: Piece, window: int) -> Tensor:
        """The stepped global copy of the piece into this rank's replica, window by window from the nodes that keep
        its shares (broadcasts: the bytes of an all-gather); the squared norm of the replica's distance to it."""
        t = self.topology
        own = piece.own_hi - piece.own_lo
        drift = torch.zeros((), dtype=torch.float64, device=t.device)
        recv = torch.empty(min(window, piece.width), dtype=piece.outer.dtype, device=t.device)
        now = torch.empty_like(recv)
        for q, size, spans in self._windows(piece, window):
            for j, (a, z) in enumerate(spans):
                if j == t.node_rank:
                    mine = max(0, min(size, own - q))
                    recv[:mine].copy_(piece.outer.detach()[q : q + mine])
                    recv[mine:size].zero_()
                self.comm.broadcast(recv[:size], src=j, group=self.inter)
                if z > a:
                    self.access.read(piece.bucket, a, z, out=now[: z - a])
                    drift += torch.linalg.vector_norm(now[: z - a].sub_(recv[: z - a]),
                                                      dtype=torch.float32).double().square()
                    self.access.write(piece.bucket, a, z, recv[: z - a])
        return drift

    def _outer_step(self, pieces: list[Piece], pseudo: list[Tensor], snapshots: list[Tensor] | None
                    ) -> tuple[list[Update], float]:
        """On the outer thread, behind the next inner steps: the pseudo-gradients averaged over the nodes, the
        outer optimizer's step, and what this rank's part of the replica takes from it; plus the node's drift
        (the norm of its pseudo-gradient of this fragment)."""
        local = torch.zeros((), dtype=torch.float64, device=self.topology.device)
        for g in pseudo:
            # A metric: float32's norm is 3x faster than float64's (and bf16 parameters get a float32 one).
            local += torch.linalg.vector_norm(g, dtype=torch.float32).double().square()
        # The node's sum runs beside the cross-node average (a local rank that starts late does not hold up the
        # others' sends); it is waited for once the average is in.
        node_sum = (self.comm.all_reduce(local, group=self.intra, async_op=True)
                    if self.topology.ranks_per_node > 1 else None)
        for piece, g in zip(pieces, pseudo):
            self.hook.on_cross_node_reduce(tensor=g, group=self.inter, bucket=piece.pseudo, offset=piece.lo).wait()
        if node_sum is not None:
            node_sum.wait()
        self._outer_optimizer_step(pieces, pseudo)
        # (the pseudo-gradients' memory takes the updates)
        return self._updates(pieces, snapshots, pseudo), float(local.sqrt())

    def _outer_optimizer_step(self, pieces: list[Piece], grads: list[Tensor]) -> None:
        # Only this fragment's pieces have a gradient, so the step moves only them (the training thread reads
        # other fragments' global copies meanwhile, never these: a fragment is sent again only once applied).
        for piece, g in zip(pieces, grads):
            piece.outer.grad = g
        self.outer.step()
        for piece in pieces:
            piece.outer.grad = None

    def _outer_step_sharded(self, pieces: list[Piece], padded: list[Tensor], shares: list[Tensor],
                            gathered: list[Tensor]) -> tuple[list[Update], float]:
        """:meth:`_outer_step` with the outer state sharded over the nodes and staleness (without it,
        :meth:`_sync_now`): each piece's snapshot reduce-scattered over the nodes, the outer step on this rank's
        share (``x - mean(s)`` as its gradient), and the stepped global copy's shares all-gathered back (as many
        bytes again: those of the all-reduce it replaces, with 1/n of the state), less the snapshot. The drift is
        the norm of that update: the node's distance to the new global copy (its pseudo-gradient would need the
        old copy of the whole piece, which no rank keeps)."""
        t = self.topology
        for s, share in zip(padded, shares):
            self.comm.reduce_scatter(share, s, group=self.inter)
        self._outer_optimizer_step(pieces, [self._outer_gradient(p, share) for p, share in zip(pieces, shares)])
        drift = torch.zeros((), dtype=torch.float64, device=t.device)
        updates = []
        for piece, s, full in zip(pieces, padded, gathered):
            values = self._gathered_outer(piece, out=full).sub_(s)[: piece.hi - piece.lo]
            drift += torch.linalg.vector_norm(values, dtype=torch.float32).double().square()
            updates.append(Update(piece.bucket, piece.lo, piece.hi, values))
        if t.ranks_per_node > 1:
            self.comm.all_reduce(drift, group=self.intra)
        return updates, float(drift.sqrt())

    def _gathered_outer(self, piece: Piece, values: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """``values`` (default: the piece's global copy) of this rank's share of the piece, all-gathered over the
        nodes into a buffer of the piece's padded size (``out``, or a new one): the whole piece's values."""
        values = piece.outer.detach() if values is None else values
        n, me = self.topology.num_nodes, self.topology.node_rank
        full = torch.empty(piece.width * n, dtype=values.dtype, device=self.topology.device) if out is None else out
        share = full[me * piece.width : (me + 1) * piece.width]
        share[: values.numel()].copy_(values)
        share[values.numel() :].zero_()
        self.comm.all_gather(full, share, group=self.inter)
        return full

    def _updates(self, pieces: list[Piece], snapshots: list[Tensor] | None, out: list[Tensor] | None = None
                 ) -> list[Update]:
        """What this rank's part of the replica takes from the stepped global copy ``x``: ``x`` itself with
        ``max_staleness=0`` (every rank then holds the same bits), else ``x - s`` (into ``out`` where given), added
        to the replica at apply time so the inner steps taken while the average was in flight are kept."""
        if self.sharded_outer:  # (a sync in flight, restored from a checkpoint: staleness > 0)
            return [Update(p.bucket, p.lo, p.hi, self._gathered_outer(p)[: p.hi - p.lo].sub_(s))
                    for p, s in zip(pieces, snapshots)]
        if self.schedule.staleness:
            return [Update(p.bucket, p.lo, p.hi, torch.sub(p.outer.detach(), s, out=o))
                    for p, s, o in zip(pieces, snapshots, out or [None] * len(pieces))]
        return [Update(p.bucket, p.lo, p.hi, p.outer.detach()) for p in pieces]

    def _apply(self, flight: InFlight) -> None:
        started = self._clock.stamp()
        with health.diagnosed(OUTER_SYNC):
            updates, drift = health.wait(flight.result)
        self._side.join()
        self._waits.add(started, self._clock.stamp())
        self.in_flight.remove(flight)
        for u in updates:
            if self.schedule.staleness:
                self.access.add(u.bucket, u.lo, u.hi, u.values)
            else:
                self.access.write(u.bucket, u.lo, u.hi, u.values)
        if self.spreads:
            # Each rank broadcasts its part into the others' parameters (the ranks of a node hold the same replica,
            # so that is what adding the others' updates would give, to the bit), without a buffer.
            self.access.publish(self.fragment_ranges[flight.fragment])
        self.syncs += 1
        self._drift.append(drift)

    # ------------------------------------------------------------------ metrics and memory

    @hookimpl
    def on_collect_metrics(self) -> dict[str, float]:
        # Per step: fragment syncs applied, the time the training thread waited for them, and (on steps that sent
        # one) the node's drift from the global copy (the norm of its pseudo-gradient over what was sent).
        self._wait_s += self._waits.take()  # (on CUDA, the waits the device has passed; the others count next time)
        metrics = {"sync/outer_syncs": float(self.syncs - self._syncs_logged), "sync/wait_ms": self._wait_s * 1e3}
        if self._drift:
            metrics["sync/drift"] = sum(d * d for d in self._drift) ** 0.5
        self._wait_s, self._drift, self._syncs_logged = 0.0, [], self.syncs
        return metrics

    @hookimpl
    def on_collect_memory(self) -> dict[str, int]:
        tensors = [p.outer for p in self.pieces]
        if self.outer is not None:
            # list(): the outer thread may be stepping (and adding state) meanwhile.
            tensors += [v for st in list(self.outer.state.values()) for v in list(st.values())
                        if isinstance(v, Tensor)]
        return {"outer_state": sum(t.numel() * t.element_size() for t in tensors)}

    # ------------------------------------------------------------------ checkpoints

    def _drain(self) -> None:
        """Wait for the averages in flight (they are saved; applying them early would change the run)."""
        with health.diagnosed(OUTER_SYNC):
            for flight in self.in_flight:
                health.wait(flight.result)
        self._side.join()

    def _names(self, piece: Piece) -> list[tuple[str, int, int, int]]:
        """(parameter name, start in the parameter, end, start in the piece's global copy) of every parameter in
        the elements whose global copy this rank keeps."""
        bucket = self.buckets[piece.bucket]
        out = []
        for i, p in enumerate(bucket.params):
            a = max(piece.own_lo, bucket.offsets[i])
            z = min(piece.own_hi, bucket.offsets[i] + local_tensor(p).numel())
            if a < z:
                out.append((bucket.names[i], a - bucket.offsets[i], z - bucket.offsets[i], a - piece.own_lo))
        return out

    def _consolidated(self, values: Callable[[Piece], Tensor | None], dtype: torch.dtype | None = None
                      ) -> dict[str, DeferredTensor | Tensor]:
        """``values`` of every piece, per parameter in its full shape, produced on global rank 0 while it writes:
        every bucket's parts are gathered inside node 0 (the nodes hold the same values)."""
        t = self.topology
        if t.tensor_parallel_size > 1 or t.pipeline_parallel_size > 1:
            # (with pipeline stages, each stage's node 0 holds its stage's values; the strategy gathers them)
            return self._whole(values, dtype)
        # (with the outer state sharded over the nodes, every node's ranks take part: each gathers its chunks'
        # values over the nodes first)
        out: dict[str, DeferredTensor | Tensor] = {}
        for b, bucket in enumerate(self.buckets):
            width = -(-bucket.numel // t.ranks_per_node)
            dtype_b = dtype or bucket.buffer.dtype
            storage = DeferredStorage(dtype=dtype_b, numel=width * t.ranks_per_node,
                                      device=str(t.device), produce=self._producer(b, values, dtype_b))
            for i, p in enumerate(bucket.params):
                out[bucket.names[i]] = DeferredTensor(storage, bucket.offsets[i], tuple(p.shape))
        return out

    def _whole(self, values: Callable[[Piece], Tensor | None], dtype: torch.dtype | None) -> dict[str, Tensor]:
        """:meth:`_consolidated` with tensor parallelism, where node 0's ranks hold local shards, or pipeline stages:
        at once, on every rank of node 0, whole plain tensors (each bucket's parts all-gathered inside the node, then each split
        parameter's blocks over its tensor-parallel group), as the checkpoint's model state is."""
        t = self.topology
        out: dict[str, Tensor] = {}
        for b, bucket in enumerate(self.buckets):
            local = self._local_part(b, values, dtype or bucket.buffer.dtype)
            flat = local.new_empty(local.numel() * t.ranks_per_node)
            self.comm.all_gather(flat, local, group=t.side_intra_node_group)
            for i, p in enumerate(bucket.params):
                shard = local_tensor(p)
                v = flat[bucket.offsets[i] : bucket.offsets[i] + shard.numel()].view(shard.shape)
                if is_tensor_parallel_shard(p):
                    v = as_parameter_layout(v, p).full_tensor()
                out[bucket.names[i]] = v.detach().cpu().clone()
        return out

    def _local_part(self, b: int, values: Callable[[Piece], Tensor | None], dtype: torch.dtype) -> Tensor:
        """This rank's part of bucket ``b`` (a node's ranks hold equal parts, in rank order) filled with
        ``values`` of its pieces."""
        part_lo, _ = self.access.parts[b]
        local = torch.zeros(-(-self.buckets[b].numel // self.topology.ranks_per_node), dtype=dtype,
                            device=self.topology.device)
        for piece in self.pieces:
            v = values(piece) if piece.bucket == b else None
            if v is not None and self.sharded_outer:  # this node's share: the others' from them
                v = self._gathered_outer(piece, v.to(dtype))[: piece.hi - piece.lo]
            if v is not None:
                local[piece.lo - part_lo : piece.hi - part_lo].copy_(v)
        return local

    def _producer(self, b: int, values: Callable[[Piece], Tensor | None], dtype: torch.dtype):
        def produce() -> Tensor | None:
            local = self._local_part(b, values, dtype)
            if self.topology.node_rank != 0:
                return None  # (its part of the gather over the nodes is done)
            return gather_flat_to_root(local, self.topology.side_intra_node_group,
                                       list(range(self.topology.ranks_per_node)))

        return produce

    @hookimpl
    def on_save_state_dict(self) -> dict[str, Any] | None:
        self._drain()
        if self.topology.node_rank != 0 and not self.sharded_outer:
            return {}  # node 0 holds every value (the nodes share them); nothing of this node is written
        # The outer thread has stepped the global copy of every fragment in flight (drained above): what is saved
        # is that copy; each rank's snapshot (its rank state) gives what its replica takes when it is applied.
        in_flight = [{"fragment": f.fragment, "apply_after": f.apply_after} for f in self.in_flight]
        state = {
            "step": self.step, "syncs": self.syncs, "every": self.schedule.every, "warmup": self.warmup,
            "fragments": self.schedule.fragments, "staleness": self.schedule.staleness,
            "params": self._consolidated(lambda p: p.outer.detach()),
            # Every state key of the outer optimizer per parameter, in its shape; a scalar (Adam's step) repeated
            # over its elements, in float64; NaN where a piece has no state yet (its fragment never synced).
            "optimizer": {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                           for g in self.outer.param_groups],
                          "state": {k: self._consolidated(lambda p, k=k: self._opt_values(p, k),
                                                          None if tensor else torch.float64)
                                    for k, tensor in self.state_kinds.items()}},
            "in_flight": in_flight,
        }
        t = self.topology
        if t.node_rank != 0 and (t.tensor_parallel_size > 1 or t.pipeline_parallel_size > 1):
            return {}  # its part of the gathers over the nodes is done (_whole gathers at once)
        return {STATE_KEY: state}

    def _opt_values(self, piece: Piece, key: str) -> Tensor:
        st = self.outer.state.get(piece.outer)
        n = piece.own_hi - piece.own_lo
        if not st or key not in st:
            return torch.full((n,), float("nan"), dtype=torch.float64)
        v = st[key]
        if isinstance(v, Tensor) and v.dim() > 0:
            return v.detach()
        return torch.full((n,), float(v), dtype=torch.float64)

    def _pieces_of(self, fragment: int) -> list[Piece]:
        return [p for p in self.pieces if p.fragment == fragment]

    @hookimpl
    def on_save_rank_state_dict(self) -> dict[str, Any]:
        # This node's replica (the nodes differ between syncs) and the snapshots of the syncs in flight.
        self._drain()
        layout = [(p.fragment, p.bucket, p.lo, p.hi) for p in self.pieces]
        replica = [self.access.read(p.bucket, p.lo, p.hi).cpu() for p in self.pieces]
        snapshots = [[s.cpu() for s in flight.snapshots] for flight in self.in_flight]
        # The inner optimizers' state differs between nodes as the replicas do, and the checkpoint's optimizer
        # state is one node's (node 0's in the consolidated layout; in the sharded layout, assembled from shards
        # that every node holds, whichever was written last), so every rank keeps its own here (whole at stage 0,
        # its shard's pieces at stages 1-3).
        inner = [_optimizer_state(o) for o in self.optimizers] if self.topology.num_nodes > 1 else None
        return {STATE_KEY: {"layout": layout, "replica": replica, "snapshots": snapshots, "inner": inner}}

    @hookimpl(wrapper=True)
    def on_load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: Mapping[str, Any]):
        loaded = yield  # the sharder's (node 0's state, this rank's pieces), or None at stage 0
        if optimizer not in self.optimizers or not self._inner_pending:
            return loaded
        if loaded is None:
            optimizer.load_state_dict(state_dict)
        own = self._inner_pending[self.optimizers.index(optimizer)]
        if own is not None and not _load_optimizer_state(optimizer, own, self.topology.device):
            log.warning("ddp_plugin: the checkpoint's inner optimizer state of node %d does not fit this"
                        " optimizer; it resumes from node 0's.", self.topology.node_rank)
        return True

    @hookimpl
    def on_load_state_dict(self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None) -> None:
        saved = state.get(STATE_KEY)
        if saved is None:
            return  # a synchronous run's checkpoint: the global copy starts from its parameters
        mode = (saved["every"], saved["fragments"], saved["staleness"], saved.get("warmup", 0))
        if mode != (self.schedule.every, self.schedule.fragments, self.schedule.staleness, self.warmup):
            log.warning("ddp_plugin: the checkpoint's sync mode (sync_every=%d, sync_fragments=%d, max_staleness=%d,"
                        " sync_warmup_steps=%d) differs from this run's; the outer state is kept, the position in the"
                        " cycle starts over (with this run's synchronous warmup steps first).", *mode)
            same_schedule = False
        else:
            same_schedule = True
        device = self.topology.device

        # With tensor parallelism the checkpoint holds whole tensors: this rank's block of each (no communication).
        split = {bucket.names[i]: p for bucket in self.buckets for i, p in enumerate(bucket.params)
                 if is_tensor_parallel_shard(p)}
        blocks: dict[tuple[int, str], Tensor] = {}

        def block(full: Mapping[str, Tensor], name: str) -> Tensor:
            value = full[name]
            p = split.get(name)
            if p is None or tuple(value.shape) != tuple(p.shape):
                return value
            if (id(full), name) not in blocks:
                blocks[(id(full), name)] = local_part_of_whole(value.to(device), p)
            return blocks[(id(full), name)]

        def piece_values(piece: Piece, full: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> Tensor:
            """The elements of ``full`` (saved per parameter, in its shape) whose global copy the piece keeps."""
            out = torch.empty(piece.own_hi - piece.own_lo, dtype=dtype or piece.outer.dtype, device=device)
            for name, a, z, at in self._names(piece):
                out[at : at + z - a].copy_(block(full, name).reshape(-1)[a:z])
            return out

        with torch.no_grad():
            for piece in self.pieces:
                piece.outer.copy_(piece_values(piece, saved["params"]))
        opt = saved["optimizer"]
        states = {}
        for j, piece in enumerate(self.pieces):
            st: dict[str, Any] = {}
            for k, tensor in self.state_kinds.items():
                full = opt["state"].get(k)
                if full is None:
                    continue
                values = piece_values(piece, full, None if tensor else torch.float64)
                if values.numel() and not torch.isnan(values[0]):
                    st[k] = values if tensor else _scalar_like(self.state_kinds_example[k], float(values[0]))
            if st:
                states[j] = st
        groups = [{**g, "params": list(range(len(self.pieces)))} for g in opt["param_groups"]][:1]
        self.outer.load_state_dict({"state": states, "param_groups": groups})
        mine = (rank_state or {}).get(STATE_KEY)
        layout = [(p.fragment, p.bucket, p.lo, p.hi) for p in self.pieces]
        if mine is not None and [tuple(x) for x in mine["layout"]] != layout:
            mine = None
        self._inner_pending = mine.get("inner") if mine is not None else None
        if mine is not None:
            for piece, values in zip(self.pieces, mine["replica"]):
                self.access.write(piece.bucket, piece.lo, piece.hi, values.to(device))
            self.access.publish([(b, 0, bucket.numel) for b, bucket in enumerate(self.buckets)])
        elif self.topology.num_nodes > 1:
            log.warning("ddp_plugin: the checkpoint holds no replica for this rank's layout (another number of"
                        " ranks, another stage or bucket size); every node resumes from node 0's parameters.")
        self.syncs = self._syncs_logged = saved["syncs"]
        self.step = saved["step"] if same_schedule else 0
        self.in_flight = []
        for k, flight in enumerate(saved["in_flight"] if same_schedule else []):
            pieces = self._pieces_of(flight["fragment"])
            if mine is not None:
                snapshots = [s.to(device) for s in mine["snapshots"][k]]
            else:
                snapshots = [self.access.read(p.bucket, p.lo, p.hi) for p in pieces]
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result((self._updates(pieces, snapshots), 0.0))
            self.in_flight.append(InFlight(flight["fragment"], flight["apply_after"], snapshots, done))


def _optimizer_state(optimizer: Optimizer) -> list[list[dict[str, Any]]]:
    """``optimizer``'s state by position (group, parameter), as this rank holds it, on the CPU."""
    # (a DTensor's local tensor: the file holds plain tensors, and a rank's own state is its own block)
    return [[{k: (local_tensor(v).detach().cpu().clone() if isinstance(v, Tensor) else v)
              for k, v in optimizer.state.get(p, {}).items()} for p in group["params"]]
            for group in optimizer.param_groups]


def _load_optimizer_state(optimizer: Optimizer, saved: list[list[dict[str, Any]]], device: torch.device) -> bool:
    """Put :func:`_optimizer_state`'s answer back; ``False`` (and nothing changed) when it does not fit."""
    groups = [group["params"] for group in optimizer.param_groups]
    if [len(g) for g in groups] != [len(g) for g in saved] or any(
        isinstance(v, Tensor) and v.dim() > 0 and v.shape != local_tensor(p).shape
        for g, sg in zip(groups, saved) for p, st in zip(g, sg) for v in st.values()
    ):
        return False
    for g, sg in zip(groups, saved):
        for p, st in zip(g, sg):
            if st:
                optimizer.state[p] = {k: (as_parameter_layout(v.to(device), p) if isinstance(v, Tensor)
                                          and v.dim() > 0 else v) for k, v in st.items()}
            else:
                optimizer.state.pop(p, None)
    return True


def _state_kinds(spec: Any) -> tuple[dict[str, bool], dict[str, Any]]:
    """The state keys the outer optimizer keeps per parameter, each with whether it is a tensor of the
    parameter's shape (else a scalar, e.g. Adam's step), found by stepping one on a one-element parameter: the
    same on every rank, whether or not this rank holds a piece that has synchronized yet."""
    probe = nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
    optimizer = build_outer_optimizer(spec, [probe])
    probe.grad = torch.ones_like(probe)
    optimizer.step()
    state = optimizer.state.get(probe, {})
    kinds = {k: isinstance(v, Tensor) and v.dim() > 0 for k, v in state.items()}
    return kinds, dict(state)


def _scalar_like(example: Any, value: float) -> Any:
    if isinstance(example, Tensor):
        return torch.tensor(value, dtype=example.dtype, device=example.device)
    return type(example)(value)


def _plain_mean(hook: HookRelay, sync: OuterSync) -> bool:
    """Whether the pseudo-gradients take the plain mean across nodes: no plugin (a codec, ``compression="auto"``'s
    choice, one of the user's) answers ``on_cross_node_reduce`` ahead of the default averaging all-reduce."""
    for impl in hook.on_cross_node_reduce.get_hookimpls():
        if impl.hookwrapper or impl.wrapper or impl.plugin is sync or impl.plugin_name == "mean_allreduce":
            continue
        return False
    return True
