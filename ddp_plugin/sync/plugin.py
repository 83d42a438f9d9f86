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

Beside it: :mod:`~ddp_plugin.sync.schedule` (when), :mod:`~ddp_plugin.sync.parts` (where a rank reads and writes
its part), :mod:`~ddp_plugin.sync.node_shards` (the global copy and outer state sharded over the nodes),
:mod:`~ddp_plugin.sync.outer_optimizer` and :mod:`~ddp_plugin.sync.state` (the checkpoint state). (Over 400 lines:
the gradients kept inside the node, the send, the outer step and the apply are one plugin's hooks over its pieces,
syncs in flight and streams, and read as one algorithm.)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin import health
from ddp_plugin.runtime.clock import Clock, Intervals
from ddp_plugin.runtime.comm import RS_PIECE_BYTES
from ddp_plugin.hookspecs import completed_future, hookimpl, local_tensor
from ddp_plugin.runtime.streams import SideStream, SideThread
from ddp_plugin.sync.node_shards import NodeShards
from ddp_plugin.sync.outer_optimizer import NESTEROV, NesterovSGD, build_outer_optimizer
from ddp_plugin.sync.parts import InFlight, ModuleChunks, Piece, ShardParts, Update
from ddp_plugin.sync.schedule import SyncSchedule, fragment_bounds
from ddp_plugin.sync.state import STATE_KEY, SyncCheckpoint
from ddp_plugin.sync.transport import NodeTransport, Round, SyncTransport

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pluggy import HookRelay
    from torch.optim import Optimizer

    from ddp_plugin.hookspecs import Bucket, Communicator, Options, Topology

log = logging.getLogger(__name__)

__all__ = ["NESTEROV", "OUTER_SYNC", "STATE_KEY", "WINDOW_BYTES", "NesterovSGD", "OuterSync", "build_outer_optimizer"]

WINDOW_BYTES = RS_PIECE_BYTES
"""A sync without staleness (outer state sharded over the nodes) reads and reduces each rank's part this much at a
time (the n shares' windows together)."""

OUTER_SYNC = "the outer (cross-node) sync"
"""What a failed sync's error says failed."""


class OuterSync:
    """Cross-node synchronization every ``every`` optimizer steps (see the module docstring). ``transport``: how a
    sync crosses the members (:class:`~ddp_plugin.sync.transport.SyncTransport`; by default the nodes, through the
    cross-node hook)."""

    def __init__(self, every: int, outer_optimizer: Any = "nesterov", fragments: int = 1, staleness: int = 0,
                 warmup: int = 0, transport: SyncTransport | None = None) -> None:
        self.transport: SyncTransport = transport if transport is not None else NodeTransport()
        self.schedule = SyncSchedule(every, fragments, staleness)
        self.warmup = warmup  # synchronous steps first (post-local SGD): the sync mode starts after step `warmup`
        self.outer_spec = outer_optimizer
        self.step = 0
        self.pieces: list[Piece] = []
        self.in_flight: list[InFlight] = []
        self.outer: torch.optim.Optimizer | None = None
        self.syncs = 0
        self.syncs_logged = 0
        self._wait_s = 0.0
        self._clock = Clock(torch.device("cpu"))
        self._waits = Intervals(self._clock)
        """The training thread's waits for syncs, as stamps of its stream (CUDA events: read once passed)."""
        self._side = SideStream(torch.device("cpu"))
        """The outer thread's CUDA stream (see ddp_plugin.runtime.streams)."""
        self._drift: list[float] = []
        self._thread: SideThread | None = None
        self.access: ShardParts | ModuleChunks | None = None
        self.optimizers: list[Optimizer] = []
        self.checkpoint: SyncCheckpoint | None = None

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
        self.node_shards = NodeShards(t, comm, self.access, self.inter, self.intra)
        # With the plain mean across nodes (no codec answers for the pseudo-gradients) the global copy and the
        # outer optimizer's state are sharded over the nodes too: 1/N of them per rank instead of 1/k.
        # (over the nodes themselves only: another transport's members reduce their own way)
        self.sharded_outer = (m > 1 and options.cross_node_codec is None
                              and isinstance(self.transport, NodeTransport))
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
        self.checkpoint = SyncCheckpoint(self)
        self._clock = Clock(t.device)
        self._waits = Intervals(self._clock)
        self._thread = SideThread(t.device, "ddp_plugin-outer")
        self._side = self._thread.side
        self.transport.setup(self, module)

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
        """Whether the step under way crosses nodes: one of the first ``warmup`` steps, or any step where a member
        is a group of several nodes (one replica: its gradients cross its own nodes; the reducer's and the
        sharder's cross stage stops at the member)."""
        return self.step < self.warmup or (not self.transport.member_is_node and self.topology.num_nodes > 1)

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
        self.transport.before_step()
        self.step += 1
        if self.step <= self.warmup:
            if self.step == self.warmup:
                # The synchronous steps are over, every rank holds the same bits: the global copy starts here.
                with torch.no_grad():
                    for piece in self.pieces:
                        piece.outer.copy_(self.access.read(piece.bucket, piece.own_lo, piece.own_hi))
        else:
            # The syncs sent earlier are applied first, then this step's sent (and applied now without
            # staleness): fragments are disjoint, so the order changes no value, and the buffers of the syncs
            # applied are free before the next one's are allocated.
            self.apply_due()
            for f in self.schedule.sent_after(self.step - self.warmup):
                self.send(f)
            self.apply_due()  # (without staleness: the syncs just sent)
        self.transport.after_step()

    def apply_due(self) -> None:
        """Apply the syncs in flight whose step has come (on the training thread)."""
        for flight in [x for x in self.in_flight if x.apply_after == self.step]:
            self._apply(flight)

    def skip(self, steps: int) -> None:
        """Move the schedule ``steps`` optimizer steps ahead (a member that joins its peers where they stand): the
        syncs in flight are applied as the peers' are, ``steps`` later too."""
        self.step += steps
        for flight in self.in_flight:
            flight.apply_after += steps

    def send(self, fragment: int) -> None:
        """Send the sync of ``fragment`` (the schedule's, after this step): its round opened by the transport,
        the pseudo-gradients averaged over the members and the outer step on the outer thread (:meth:`run_outer`)
        or here, recorded in :attr:`in_flight` to be applied (:meth:`apply_due`)."""
        if self.sharded_outer and not self.schedule.staleness:
            self._sync_now(fragment, self.pieces_of(fragment))
            return
        if self.sharded_outer:
            # Every buffer the outer step works in is allocated here, on the training thread, which frees them
            # once the sync is applied (the outer thread's own heap stays small); the snapshots are what is
            # reduced, each padded to n equal shares.
            pieces = self.pieces_of(fragment)
            padded = [self.node_shards.read_padded(p) for p in pieces]
            snapshots = [x[: p.hi - p.lo] for p, x in zip(pieces, padded)]
            shares = [torch.empty(p.width, dtype=x.dtype, device=x.device) for p, x in zip(pieces, padded)]
            gathered = [torch.empty_like(x) for x in padded]
            result = self.run_outer(self.node_shards.outer_step, pieces, padded, shares, gathered,
                                    self.outer_optimizer_step)
            self.in_flight.append(InFlight(fragment, self.step + self.schedule.staleness, snapshots, result))
            return
        round = self.transport.begin(fragment, stale=bool(self.schedule.staleness))
        # A stale round's snapshots are taken now (its pseudo-gradients are those of this step); a round the
        # training thread waits for reads the replica on the outer thread, each try afresh (the transport may
        # name another fragment for a try), and its updates are the global copy itself.
        snapshots = ([self.access.read(p.bucket, p.lo, p.hi) for p in self.pieces_of(round.fragment)]
                     if round.stale else None)
        # (the stale round's pseudo-gradients, then its updates, in buffers of the training thread's, which frees
        # them once the sync is applied: the outer thread's own heap stays small)
        buffers = [torch.empty_like(x) for x in snapshots] if snapshots is not None else None
        flight = InFlight(round.fragment, self.step + (self.schedule.staleness if round.stale else 0),
                          snapshots or [], None, written=not round.stale)
        flight.result = self.run_outer(self._round, flight, round, snapshots, buffers)
        self.in_flight.append(flight)

    def run_outer(self, step: Callable[..., Any], *args: Any) -> Future:
        """``step(*args)`` on the outer thread, its stream past what the training thread queued until now; the
        future of its result. (The tensors it uses stay referenced by the sync in flight until the training stream
        has waited for the outer one, in _apply: their memory is not reused meanwhile.)"""
        return self._thread.submit(self._on_side, self._side.hand_over(), step, *args)

    def _on_side(self, ready: torch.cuda.Event | None, step: Callable[..., Any], *args: Any) -> Any:
        self._side.receive(ready)
        return step(*args)

    def _sync_now(self, fragment: int, pieces: list[Piece]) -> None:
        """A sync without staleness, with the outer state sharded over the nodes, on the training thread (which
        would wait for it anyway), in windows of at most ``WINDOW_BYTES`` of each piece's part: each window's
        shares reduce-scattered over the nodes (the same sums as the whole part's, element by element), one
        outer step, then each window's stepped shares broadcast from the nodes that keep them, written into the
        replica (the node's drift counted on the way), and each bucket's range spread inside the node. At the
        peak: this rank's shares of the mean (S/N) and a window, instead of a bucket's part."""
        started = self._clock.stamp()
        t = self.topology
        window = max(1, WINDOW_BYTES // (t.num_nodes * 4))  # elements of a share per window (fp32: 4 MiB buffers)
        mine = {p.bucket: p for p in pieces}
        with health.diagnosed(OUTER_SYNC):
            self.outer_optimizer_step(pieces, [self.node_shards.outer_gradient(p, window) for p in pieces])
            drift = torch.zeros((), dtype=torch.float64, device=t.device)
            for b, lo, hi in self.fragment_ranges[fragment]:
                piece = mine.get(b)
                if piece is not None:
                    drift += self.node_shards.take_global_copy(piece, window)
                if self.spreads:
                    self.access.publish([(b, lo, hi)])
            if t.ranks_per_node > 1:
                self.comm.all_reduce(drift, group=t.side_intra_node_group)
        self.comm.release_scratch()  # the reduce-scatter's piece: syncs are `sync_every` steps apart
        self._waits.add(started, self._clock.stamp())
        self.syncs += 1
        self._drift.append(float(drift.sqrt()))

    def _round(self, flight: InFlight, round: Round, snapshots: list[Tensor] | None, buffers: list[Tensor] | None
               ) -> tuple[list[Update], float]:
        """On the outer thread, now or behind the next inner steps: the round's pseudo-gradients averaged over the
        members (tried again where a try did not commit, up to the transport's ``retries``), the outer optimizer's
        step of a committed try, and what this rank's part of the replica takes from it; plus the member's drift
        (the norm of its pseudo-gradient of this fragment)."""
        t = self.topology
        committed = False
        for attempt in range(self.transport.retries + 1):
            if attempt:  # (from the replicas as they were: a sync is applied only once done)
                self.transport.again(round)
            pieces = self.pieces_of(round.fragment)
            if snapshots is None:  # (the snapshots serve only here: the pseudo-gradients take their memory)
                pseudo = [torch.sub(p.outer.detach(), s, out=s)
                          for p, s in ((p, self.access.read(p.bucket, p.lo, p.hi)) for p in pieces)]
            else:
                pseudo = [torch.sub(p.outer.detach(), s, out=b) for p, s, b in zip(pieces, snapshots, buffers)]
            local = self.squared_norm(pseudo)
            # The node's sum runs beside the members' average (a local rank that starts late does not hold up the
            # others' sends); it is waited for once the average is in.
            node_sum = self.comm.all_reduce(local, group=self.intra, async_op=True) if t.ranks_per_node > 1 else None
            if 0.0 < round.scale < 1.0:  # (a member whose round carries fewer inner steps than its peers')
                for g in pseudo:
                    g.mul_(round.scale)
            self.transport.reduce([(g, piece.pseudo, piece.lo) for piece, g in zip(pieces, pseudo)])
            if node_sum is not None:
                node_sum.wait()
            committed = self.transport.commit()
            if committed:
                self.outer_optimizer_step(pieces, pseudo)
                self.transport.stepped()
                break
        self.transport.end(round, committed)
        flight.fragment = round.fragment
        # (the pseudo-gradients' memory takes the updates)
        return self.updates(pieces, snapshots, pseudo), float(local.sqrt())

    def squared_norm(self, tensors: list[Tensor]) -> Tensor:
        """The squared norm of ``tensors`` together, in float64 (the drift metric)."""
        total = torch.zeros((), dtype=torch.float64, device=self.topology.device)
        for g in tensors:
            # A metric: float32's norm is 3x faster than float64's (and bf16 parameters get a float32 one).
            total += torch.linalg.vector_norm(g, dtype=torch.float32).double().square()
        return total

    def outer_optimizer_step(self, pieces: list[Piece], grads: list[Tensor]) -> None:
        """The outer optimizer's step of ``pieces``' global copies, ``grads`` their averaged pseudo-gradients."""
        # Only this fragment's pieces have a gradient, so the step moves only them (the training thread reads
        # other fragments' global copies meanwhile, never these: a fragment is sent again only once applied).
        for piece, g in zip(pieces, grads):
            piece.outer.grad = g
        self.outer.step()
        for piece in pieces:
            piece.outer.grad = None

    def gathered_outer(self, piece: Piece, values: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """The whole piece's global copy (or ``values`` of this rank's share), from the nodes that keep its shares
        (:meth:`NodeShards.gathered <ddp_plugin.sync.node_shards.NodeShards.gathered>`)."""
        return self.node_shards.gathered(piece, values, out)

    def updates(self, pieces: list[Piece], snapshots: list[Tensor] | None, out: list[Tensor] | None = None
                 ) -> list[Update]:
        """What this rank's part of the replica takes from the stepped global copy ``x``: ``x`` itself for a sync
        applied in the step that sent it (no ``snapshots``: every rank then holds the same bits), else ``x - s``
        (into ``out`` where given), added to the replica at apply time so the inner steps taken while the average
        was in flight are kept."""
        if self.sharded_outer:  # (a sync in flight, restored from a checkpoint: staleness > 0)
            return [Update(p.bucket, p.lo, p.hi, self.gathered_outer(p)[: p.hi - p.lo].sub_(s))
                    for p, s in zip(pieces, snapshots)]
        if snapshots is not None:
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
            if self.schedule.staleness and not flight.written:
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
        metrics = {"sync/outer_syncs": float(self.syncs - self.syncs_logged), "sync/wait_ms": self._wait_s * 1e3}
        if self._drift:
            metrics["sync/drift"] = sum(d * d for d in self._drift) ** 0.5
        self._wait_s, self._drift, self.syncs_logged = 0.0, [], self.syncs
        return metrics

    @hookimpl
    def on_collect_memory(self) -> dict[str, int]:
        tensors = [p.outer for p in self.pieces]
        if self.outer is not None:
            # list(): the outer thread may be stepping (and adding state) meanwhile.
            tensors += [v for st in list(self.outer.state.values()) for v in list(st.values())
                        if isinstance(v, Tensor)]
        return {"outer_state": sum(t.numel() * t.element_size() for t in tensors)}

    # ------------------------------------------------------------------ members that come and go

    def _member_state(self) -> dict[str, Any]:
        # (references: the outer thread steps them only inside a sync, after its commit, once a transfer is done)
        return {"sync": {"syncs": self.syncs, "outer": [p.outer.detach() for p in self.pieces],
                         "optimizer": self.outer.state_dict()}}

    def _load_member_state(self, state: Mapping[str, Any], into_replica: bool) -> None:
        # (every member has the same layout: the same pieces as the peer's; the global copy is never sharded over
        # the nodes where members come and go: a member that is a node has no nodes of its own to shard it over)
        state = state["sync"]
        with torch.no_grad():
            for piece, value in zip(self.pieces, state["outer"], strict=True):
                piece.outer.copy_(value)
                if into_replica:
                    self.access.write(piece.bucket, piece.own_lo, piece.own_hi, piece.outer.detach())
        self.outer.load_state_dict(state["optimizer"])
        self.syncs = self.syncs_logged = state["syncs"]
        if into_replica:
            self.access.publish([r for ranges in self.fragment_ranges.values() for r in ranges])

    @hookimpl
    def on_member_state(self) -> dict[str, Any]:
        """On a live member, in a sync a returning one heals in: the global copy and the outer optimizer's state
        (the schedule's position is the transport's to hand over)."""
        return self._member_state()

    @hookimpl
    def on_load_member_state(self, state: Mapping[str, Any]) -> None:
        """On the returning member's ranks, inside the sync's commit (on the outer thread, the training thread
        waiting for it)."""
        self._load_member_state(state, into_replica=False)

    @hookimpl
    def on_member_sync_state(self, covers: set[int]) -> dict[str, Any]:
        """On a live member between syncs (a heal server's thread): the global copy and outer state as of the last
        sync (changed only inside one); ``covers``: every synced parameter (a joining member's replica takes the
        global copy)."""
        covers.update(id(p) for bucket in self.buckets for p in bucket.params)
        return self._member_state()

    @hookimpl
    def on_load_member_sync_state(self, state: Mapping[str, Any], covers: set[int]) -> None:
        """On a member joining between syncs, before its first step: the global copy and outer state, the replica
        made the global copy (spread inside the member)."""
        covers.update(id(p) for bucket in self.buckets for p in bucket.params)
        self._load_member_state(state, into_replica=True)

    # ------------------------------------------------------------------ checkpoints

    def drain(self) -> None:
        """Wait for the averages in flight (they are saved; applying them early would change the run)."""
        with health.diagnosed(OUTER_SYNC):
            for flight in self.in_flight:
                health.wait(flight.result)
        self._side.join()

    def pieces_of(self, fragment: int) -> list[Piece]:
        return [p for p in self.pieces if p.fragment == fragment]

    @hookimpl
    def on_save_state_dict(self) -> dict[str, Any] | None:
        return self.checkpoint.save()

    @hookimpl
    def on_save_rank_state_dict(self) -> dict[str, Any]:
        return self.checkpoint.save_rank()

    @hookimpl(wrapper=True)
    def on_load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: Mapping[str, Any]):
        loaded = yield  # the sharder's (node 0's state, this rank's pieces), or None at stage 0
        return self.checkpoint.load_inner_optimizer(optimizer, state_dict, loaded) if self.checkpoint else loaded

    @hookimpl
    def on_load_state_dict(self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None) -> None:
        self.checkpoint.load(state, rank_state)

