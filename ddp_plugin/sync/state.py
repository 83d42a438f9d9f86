"""The sync mode's part of a checkpoint (``SyncCheckpoint``, asked by the plugin's checkpoint hooks): the global
copy and the outer optimizer's state, consolidated per parameter in its full shape (so a run on another number of
ranks, nodes or stages resumes from it); each rank's own replica, snapshots of the syncs in flight and inner
optimizer state (the nodes differ between syncs); and putting them back."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from ddp_plugin.runtime.comm import gather_flat_to_root
from ddp_plugin.hookspecs import (
    DeferredStorage,
    DeferredTensor,
    as_parameter_layout,
    is_tensor_parallel_shard,
    local_part_of_whole,
    local_tensor,
)
from ddp_plugin.sync.parts import InFlight
from ddp_plugin.sync.outer_optimizer import load_optimizer_state, optimizer_state, scalar_like, state_kinds

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from ddp_plugin.hookspecs import Bucket, Communicator, Topology
    from ddp_plugin.sync.parts import ModuleChunks, Piece, ShardParts, Update
    from ddp_plugin.sync.schedule import SyncSchedule

log = logging.getLogger(__name__)

STATE_KEY = "sync/outer"
"""The key of the sync mode's state in the checkpoint's plugin state and in each rank's own state."""


class CheckpointedSync(Protocol):
    """What the checkpoint reads and writes of a sync mode (:class:`~ddp_plugin.sync.plugin.OuterSync`, set up):
    where its pieces are, their global copy and outer state, the syncs in flight, the step counts."""

    topology: Topology
    comm: Communicator
    schedule: SyncSchedule
    buckets: list[Bucket]
    pieces: list[Piece]
    access: ShardParts | ModuleChunks | None
    in_flight: list[InFlight]
    outer: torch.optim.Optimizer | None
    outer_spec: Any
    optimizers: list[Optimizer]
    sharded_outer: bool
    step: int
    warmup: int
    syncs: int
    syncs_logged: int

    def gathered_outer(self, piece: Piece, values: Tensor | None = None, out: Tensor | None = None) -> Tensor: ...

    def drain(self) -> None: ...

    def pieces_of(self, fragment: int) -> list[Piece]: ...

    def updates(self, pieces: list[Piece], snapshots: list[Tensor] | None, out: list[Tensor] | None = None
                ) -> list[Update]: ...


class SyncCheckpoint:
    """The checkpoint state of ``sync``, a sync mode that is set up (:class:`CheckpointedSync`)."""

    def __init__(self, sync: CheckpointedSync) -> None:
        self.sync = sync
        self.state_kinds, self.state_kinds_example = state_kinds(sync.outer_spec)
        """The outer optimizer's state keys, each with whether it is a tensor of the parameter's shape."""
        self.inner_pending: list[Any] | None = None
        """This rank's inner optimizer state from the checkpoint, until the optimizers load theirs."""

    def _names(self, piece: Piece) -> list[tuple[str, int, int, int]]:
        """(parameter name, start in the parameter, end, start in the piece's global copy) of every parameter in
        the elements whose global copy this rank keeps."""
        sync = self.sync
        bucket = sync.buckets[piece.bucket]
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
        sync = self.sync
        t = sync.topology
        if t.tensor_parallel_size > 1 or t.pipeline_parallel_size > 1:
            # (with pipeline stages, each stage's node 0 holds its stage's values; the strategy gathers them)
            return self._whole(values, dtype)
        # (with the outer state sharded over the nodes, every node's ranks take part: each gathers its chunks'
        # values over the nodes first)
        out: dict[str, DeferredTensor | Tensor] = {}
        for b, bucket in enumerate(sync.buckets):
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
        sync = self.sync
        t = sync.topology
        out: dict[str, Tensor] = {}
        for b, bucket in enumerate(sync.buckets):
            local = self._local_part(b, values, dtype or bucket.buffer.dtype)
            flat = local.new_empty(local.numel() * t.ranks_per_node)
            sync.comm.all_gather(flat, local, group=t.side_intra_node_group)
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
        sync = self.sync
        part_lo, _ = sync.access.parts[b]
        local = torch.zeros(-(-sync.buckets[b].numel // sync.topology.ranks_per_node), dtype=dtype,
                            device=sync.topology.device)
        for piece in sync.pieces:
            v = values(piece) if piece.bucket == b else None
            if v is not None and sync.sharded_outer:  # this node's share: the others' from them
                v = sync.gathered_outer(piece, v.to(dtype))[: piece.hi - piece.lo]
            if v is not None:
                local[piece.lo - part_lo : piece.hi - part_lo].copy_(v)
        return local

    def _producer(self, b: int, values: Callable[[Piece], Tensor | None], dtype: torch.dtype):
        sync = self.sync
        def produce() -> Tensor | None:
            local = self._local_part(b, values, dtype)
            if sync.topology.node_rank != 0:
                return None  # (its part of the gather over the nodes is done)
            return gather_flat_to_root(local, sync.topology.side_intra_node_group,
                                       list(range(sync.topology.ranks_per_node)))

        return produce

    def save(self) -> dict[str, Any] | None:
        """The plugin's ``on_save_state_dict``: the global copy, the outer optimizer's state and the syncs in flight,
        consolidated per parameter."""
        sync = self.sync
        sync.drain()
        if sync.topology.node_rank != 0 and not sync.sharded_outer:
            return {}  # node 0 holds every value (the nodes share them); nothing of this node is written
        # The outer thread has stepped the global copy of every fragment in flight (drained above): what is saved
        # is that copy; each rank's snapshot (its rank state) gives what its replica takes when it is applied.
        in_flight = [{"fragment": f.fragment, "apply_after": f.apply_after} for f in sync.in_flight]
        state = {
            "step": sync.step, "syncs": sync.syncs, "every": sync.schedule.every, "warmup": sync.warmup,
            "fragments": sync.schedule.fragments, "staleness": sync.schedule.staleness,
            "params": self._consolidated(lambda p: p.outer.detach()),
            # Every state key of the outer optimizer per parameter, in its shape; a scalar (Adam's step) repeated
            # over its elements, in float64; NaN where a piece has no state yet (its fragment never synced).
            "optimizer": {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                           for g in sync.outer.param_groups],
                          "state": {k: self._consolidated(lambda p, k=k: self._opt_values(p, k),
                                                          None if tensor else torch.float64)
                                    for k, tensor in self.state_kinds.items()}},
            "in_flight": in_flight,
        }
        t = sync.topology
        if t.node_rank != 0 and (t.tensor_parallel_size > 1 or t.pipeline_parallel_size > 1):
            return {}  # its part of the gathers over the nodes is done (_whole gathers at once)
        return {STATE_KEY: state}

    def _opt_values(self, piece: Piece, key: str) -> Tensor:
        sync = self.sync
        st = sync.outer.state.get(piece.outer)
        n = piece.own_hi - piece.own_lo
        if not st or key not in st:
            return torch.full((n,), float("nan"), dtype=torch.float64)
        v = st[key]
        if isinstance(v, Tensor) and v.dim() > 0:
            return v.detach()
        return torch.full((n,), float(v), dtype=torch.float64)

    def save_rank(self) -> dict[str, Any]:
        """The plugin's ``on_save_rank_state_dict``."""
        sync = self.sync
        # This node's replica (the nodes differ between syncs) and the snapshots of the syncs in flight.
        sync.drain()
        layout = [(p.fragment, p.bucket, p.lo, p.hi) for p in sync.pieces]
        replica = [sync.access.read(p.bucket, p.lo, p.hi).cpu() for p in sync.pieces]
        snapshots = [[s.cpu() for s in flight.snapshots] for flight in sync.in_flight]
        # The inner optimizers' state differs between nodes as the replicas do, and the checkpoint's optimizer
        # state is one node's (node 0's in the consolidated layout; in the sharded layout, assembled from shards
        # that every node holds, whichever was written last), so every rank keeps its own here (whole at stage 0,
        # its shard's pieces at stages 1-3).
        inner = [optimizer_state(o) for o in sync.optimizers] if sync.topology.num_nodes > 1 else None
        return {STATE_KEY: {"layout": layout, "replica": replica, "snapshots": snapshots, "inner": inner}}

    def load_inner_optimizer(self, optimizer: Optimizer, state_dict: Mapping[str, Any], loaded: bool | None
                             ) -> bool | None:
        """The plugin's ``on_load_optimizer_state_dict`` after the sharder's (``loaded``: its answer): this rank's own
        inner optimizer state, where the checkpoint holds one for it."""
        sync = self.sync
        sync = self.sync
        if optimizer not in sync.optimizers or not self.inner_pending:
            return loaded
        if loaded is None:
            optimizer.load_state_dict(state_dict)
        own = self.inner_pending[sync.optimizers.index(optimizer)]
        if own is not None and not load_optimizer_state(optimizer, own, sync.topology.device):
            log.warning("ddp_plugin: the checkpoint's inner optimizer state of node %d does not fit this"
                        " optimizer; it resumes from node 0's.", sync.topology.node_rank)
        return True

    def load(self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None) -> None:
        """The plugin's ``on_load_state_dict``."""
        sync = self.sync
        saved = state.get(STATE_KEY)
        if saved is None:
            return  # a synchronous run's checkpoint: the global copy starts from its parameters
        mode = (saved["every"], saved["fragments"], saved["staleness"], saved.get("warmup", 0))
        if mode != (sync.schedule.every, sync.schedule.fragments, sync.schedule.staleness, sync.warmup):
            log.warning("ddp_plugin: the checkpoint's sync mode (sync_every=%d, sync_fragments=%d, max_staleness=%d,"
                        " sync_warmup_steps=%d) differs from this run's; the outer state is kept, the position in the"
                        " cycle starts over (with this run's synchronous warmup steps first).", *mode)
            same_schedule = False
        else:
            same_schedule = True
        device = sync.topology.device

        # With tensor parallelism the checkpoint holds whole tensors: this rank's block of each (no communication).
        split = {bucket.names[i]: p for bucket in sync.buckets for i, p in enumerate(bucket.params)
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
            for piece in sync.pieces:
                piece.outer.copy_(piece_values(piece, saved["params"]))
        opt = saved["optimizer"]
        states = {}
        for j, piece in enumerate(sync.pieces):
            st: dict[str, Any] = {}
            for k, tensor in self.state_kinds.items():
                full = opt["state"].get(k)
                if full is None:
                    continue
                values = piece_values(piece, full, None if tensor else torch.float64)
                if values.numel() and not torch.isnan(values[0]):
                    st[k] = values if tensor else scalar_like(self.state_kinds_example[k], float(values[0]))
            if st:
                states[j] = st
        groups = [{**g, "params": list(range(len(sync.pieces)))} for g in opt["param_groups"]][:1]
        sync.outer.load_state_dict({"state": states, "param_groups": groups})
        mine = (rank_state or {}).get(STATE_KEY)
        layout = [(p.fragment, p.bucket, p.lo, p.hi) for p in sync.pieces]
        if mine is not None and [tuple(x) for x in mine["layout"]] != layout:
            mine = None
        self.inner_pending = mine.get("inner") if mine is not None else None
        if mine is not None:
            for piece, values in zip(sync.pieces, mine["replica"]):
                sync.access.write(piece.bucket, piece.lo, piece.hi, values.to(device))
            sync.access.publish([(b, 0, bucket.numel) for b, bucket in enumerate(sync.buckets)])
        elif sync.topology.num_nodes > 1:
            log.warning("ddp_plugin: the checkpoint holds no replica for this rank's layout (another number of"
                        " ranks, another stage or bucket size); every node resumes from node 0's parameters.")
        sync.syncs = sync.syncs_logged = saved["syncs"]
        sync.step = saved["step"] if same_schedule else 0
        sync.in_flight = []
        for k, flight in enumerate(saved["in_flight"] if same_schedule else []):
            pieces = sync.pieces_of(flight["fragment"])
            if mine is not None:
                snapshots = [s.to(device) for s in mine["snapshots"][k]]
            else:
                snapshots = [sync.access.read(p.bucket, p.lo, p.hi) for p in pieces]
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result((sync.updates(pieces, snapshots), 0.0))
            sync.in_flight.append(InFlight(flight["fragment"], flight["apply_after"], snapshots, done))
