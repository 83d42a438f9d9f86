"""``ZeroSharder``: the ZeRO plugin on the hook contract. It only wires hooks to the parts of
:mod:`ddp_plugin.zero` (layout, shards, reduction, units, optimizer view, gradients, checkpoints)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ddp_plugin.runtime.comm import broadcast_coalesced

from ddp_plugin.hookspecs import ParameterShards, completed_future, hookimpl
from ddp_plugin.zero import checkpoint, gradients
from ddp_plugin.zero.backward_step import StepInBackward
from ddp_plugin.zero.layout import Scope, ShardLayout
from ddp_plugin.zero.offload import DiskOffload, Offload
from ddp_plugin.zero.optimizer import ShardedOptimizers
from ddp_plugin.zero.reduce import ShardReducer
from ddp_plugin.zero.shards import Shards
from ddp_plugin.zero.units import UnitPlan, Units, check_auto_wrap_policy, plan_units

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch.optim import Optimizer

    from ddp_plugin.hookspecs import Bucket, Communicator, Options, Topology
    from ddp_plugin.plugins.cross_stage import CrossStage

log = logging.getLogger(__name__)


class ZeroSharder:
    """ZeRO stage 1, 2 or 3 over ``shard_scope`` ("global": every rank; "node": the ranks of a node).

    One step, for every stage:

    1. backward: as each bucket fills, it is reduced to this rank's shard only (:class:`ShardReducer`);
    2. the optimizer steps only this rank's shard: the user's optimizer object is kept, but its parameter groups
       now hold 1-D pieces of the shards, so its state exists for 1/P of the elements (elementwise optimizers
       compute exactly what they would on whole tensors);
    3. after the step the updated shards are all-gathered into the flat parameters every module parameter views
       (stages 1 and 2), or left sharded until the next forward needs them (stage 3, :class:`Units`).

    Stage 1 keeps every bucket's gradient buffer filled with the mean, so the module's ``.grad`` is whole from
    the end of backward until the next backward, as under DDP. Stages 2 and 3 release the buffers as soon as
    their shard is reduced; ``on_gather_full_gradients`` lends the whole gradients on demand and
    ``on_grad_norms`` computes their norms from the shards. Frozen parameters are not sharded.
    """

    def __init__(self, stage: int, shard_scope: str = "global", auto_wrap_policy: Any = None,
                 prefetch_units: int = 2, cross_stage: CrossStage | None = None,
                 optimizer_in_backward: bool = False, offload: Offload | None = None) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"`zero_stage={stage!r}`: the sharder handles stages 1, 2, 3.")
        if shard_scope not in ("global", "node"):
            raise ValueError(f"`shard_scope={shard_scope!r}` is not supported; allowed values: 'global', 'node'.")
        self.stage = stage
        self.shard_scope = shard_scope
        self.policy = check_auto_wrap_policy(auto_wrap_policy)
        self.prefetch_units = prefetch_units
        self.cross_stage = cross_stage
        """The cross-node stage of the gradients' node shards, if not the hook (fault tolerance's)."""
        self.offload = offload
        """Where the optimizer state is kept between the bucket-by-bucket updates (:mod:`ddp_plugin.zero.offload`)."""
        self.in_backward = StepInBackward(offload) if optimizer_in_backward else None
        """Stages 2-3: each bucket's shard stepped once its gradient is reduced
        (:mod:`ddp_plugin.zero.backward_step`)."""
        self._plan: UnitPlan | None = None
        self.shards: Shards | None = None
        self.units: Units | None = None
        self.optimizers: ShardedOptimizers | None = None
        self._reduce: ShardReducer | None = None
        self._lent: gradients.LentGradients | None = None
        self._grads_published = False  # stage 1: see _register_stage_1_hooks
        self._handles: list[Any] = []

    @property
    def params_on_disk(self) -> bool:
        """Stage 3 with ``offload="disk"`` and ``offload_params``: each unit's shard lives in a mapped file."""
        return isinstance(self.offload, DiskOffload) and self.offload.params

    # ------------------------------------------------------------------ setup

    @hookimpl
    def on_plan_buckets(self, module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]], cap_bytes: int,
                        solo: Sequence[nn.Parameter]) -> list[list[tuple[str, nn.Parameter]]] | None:
        if self.stage != 3:
            return None
        self._plan = plan_units(module, named_params, self.policy, solo, cap_bytes)
        return self._plan.bucket_groups()

    @hookimpl
    def on_setup(self, topology: Topology, buckets: Sequence[Bucket], hook: HookRelay, options: Options,
                 comm: Communicator) -> None:
        layout = ShardLayout.of(topology, self.shard_scope, options.hierarchical)
        unit_buckets = ()
        if self.stage == 3:
            assert self._plan is not None, "on_plan_buckets did not run"
            unit_buckets = {b for b, (name, _) in enumerate(self._plan.order) if name}
        self.shards = Shards(buckets, layout, comm, release_gradients=self.stage >= 2,
                             release_parameters=unit_buckets,
                             initialize=lambda params: hook.on_initialize_parameters(params=params),
                             keep_shard=self.offload.shard_to_disk if self.params_on_disk else None)
        if self.offload is not None:
            self.offload.setup(self.shards.entries)
        self.units = (Units(self._plan, self.shards, self.prefetch_units, hold=topology.pipeline_parallel_size > 1)
                      if self.stage == 3 else None)
        if self.units is not None and self.params_on_disk:
            self.units.after_gather = self.offload.after_gather
        if self.stage == 1:
            self._register_stage_1_hooks()
        self.optimizers = ShardedOptimizers(self.shards, self.shards.make_pieces(), self.stage)
        self._reduce = ShardReducer(layout, comm, hook, whole=self.stage == 1, plain=options.cross_node_codec is None,
                                    cross=self.cross_stage)
        self._lent = gradients.LentGradients(self.shards)

    @hookimpl
    def on_setup_optimizer(self, optimizer: Optimizer) -> None:
        self.optimizers.shard(optimizer)
        if self.in_backward is not None:
            self.in_backward.set_optimizer(optimizer)
        if self.offload is not None:
            self.offload.set_optimizer(optimizer)

    @hookimpl
    def on_teardown(self, failed: bool) -> None:
        if self.offload is not None:
            self.offload.close()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.units is not None:
            self.units.remove_hooks()
            if failed:  # (a gather with a rank that is gone would wait out the timeout)
                return
            if self.params_on_disk:
                # The model does not fit in memory whole: it is gathered into mapped files, which the kernel pages
                # in and out as the module is used after fit.
                self.units.gather_all_into(self.offload.whole_bucket, self.offload.after_gather)
                return
            # Leave the module whole after fit (validation, export, `trainer.save_checkpoint`).
            try:
                self.units.gather_all()
            except Exception as err:  # noqa: BLE001 - after a failed run; the original error is what matters
                log.warning("ZeRO stage 3: could not gather the parameters at teardown: %s", err)

    # ------------------------------------------------------------------ backward

    @hookimpl
    def on_bucket_ready(self, bucket: Bucket) -> torch.futures.Future:
        shard = self._reduce(bucket)
        entry = self.shards.entries[bucket.index]
        if self.stage == 1:
            entry.grad = shard  # a slice of the bucket, which holds the whole mean
        else:
            if shard.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr():
                shard = shard.clone()
            entry.grad = shard
            # (Every parameter got a gradient on this rank: each is one some rank used, so it is stepped after
            # backward too; otherwise the ranks' agreement on which were used, at the end of backward, decides.)
            whole = self.in_backward is not None and all(p.grad is not None for p in bucket.params)
            bucket.release()
            if whole:
                self.in_backward.step(bucket.index, entry)
        return completed_future(None)

    @hookimpl
    def on_gradient_shard(self, bucket: Bucket) -> tuple[int, Tensor] | None:
        if self.stage == 1:
            return None  # the bucket holds the whole mean
        grad = self.shards.entries[bucket.index].grad
        return None if grad is None else (self.shards.layout.shard_index * grad.numel(), grad)

    @hookimpl
    def on_after_backward(self, buckets: Sequence[Bucket]) -> None:
        stepped = self.in_backward.stepped if self.in_backward is not None else set()
        for bucket, entry in zip(self.shards.buckets, self.shards.entries):
            grad, entry.grad = entry.grad, None
            for piece in entry.pieces if bucket.index not in stepped else ():
                # A parameter no rank used has no gradient, as in one process: its pieces are skipped too.
                used = bucket.grad_used[piece.index]
                piece.param.grad = grad[piece.at : piece.at + piece.param.numel()] if used else None
            if self.stage > 1:
                for p in bucket.params:
                    p.grad = None  # the optimizer steps the pieces; the module's buckets were released
        stepped.clear()
        # Stage 1: the engine left each used parameter's `.grad` viewing the bucket, which holds the whole mean.
        self._grads_published = self.stage == 1
        if self.units is not None:
            self.units.free_all()
            self.units.order_known = True

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
                for bucket in self.shards.buckets:
                    for p in bucket.params:
                        p.grad = None

        for bucket in self.shards.buckets:
            for p in bucket.params:
                self._handles.append(p.register_hook(discard_published))

    # ------------------------------------------------------------------ gradients for user hooks

    @hookimpl
    def on_gather_full_gradients(self, gather: bool) -> None:
        if self.stage == 1:
            return  # the module's gradients are whole already
        if gather:
            self._lent.lend()
        else:
            self._lent.take_back()

    @hookimpl
    def on_grad_norms(self, module: nn.Module, norm_type: float) -> dict[str, Tensor] | None:
        if self.stage == 1:
            return None  # `.grad` is whole: Lightning's grad_norm reads it
        return gradients.grad_norms(self.shards, module, norm_type)

    # ------------------------------------------------------------------ optimizer step

    @hookimpl
    def on_clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        return gradients.clip_grad_norm(self.shards, optimizer, max_norm, whole_buckets=self.stage == 1)

    @hookimpl
    def on_before_optimizer_update(self, optimizer: Optimizer) -> None:
        # With offload, the update runs here bucket by bucket (each bucket's state brought in and sent back out);
        # the optimizer's own step then finds no gradient left.
        if self.offload is not None and self.optimizers is not None and optimizer in self.optimizers:
            self.offload.step_buckets(optimizer)

    @hookimpl
    def on_after_optimizer_step(self, optimizer: Optimizer) -> None:
        self._publish()

    @hookimpl
    def on_step_start(self) -> None:
        # Stages 2-3: the last step's gradient shards are freed before this step's forward. Lightning runs a step's
        # forward before its `zero_grad`, which would free them: kept, they are held through the forward, S/N beside
        # the units it gathers. Until then (`on_train_batch_end`, the next `on_train_batch_start`) they are there
        # to read, as under DDP; a backward that synchronizes sets them anew. (Stage 1's pieces view the buckets,
        # which hold the whole mean for the module's `.grad` until the next backward, as under DDP.)
        if self.stage > 1 and self.shards is not None:
            for entry in self.shards.entries:
                for piece in entry.pieces:
                    piece.param.grad = None

    def _publish(self) -> None:
        """Make the module's parameters hold the shards' values: all-gathered into the flat parameters (stages
        1-2, and the root unit), or freed where a stage 3 unit is gathered again when used."""
        for entry, bucket in zip(self.shards.entries, self.shards.buckets):
            unit = self.units.of_bucket.get(bucket.index) if self.units is not None else None
            if unit is not None and not unit.persistent:
                if unit.gathered:
                    self.units.free(unit)  # stale now; gathered again when the next forward needs it
                continue
            self.shards.gather(entry.full, entry.shard.clone())

    @hookimpl
    def on_parameter_shards(self) -> ParameterShards | None:
        if self.shards is None or self.shards.layout.scope is not Scope.NODE:
            return None  # global shards: a node does not hold a whole copy
        index = self.shards.layout.shard_index
        parts = [(bucket, index * entry.shard.numel(), entry.shard)
                 for bucket, entry in zip(self.shards.buckets, self.shards.entries)]
        return ParameterShards(parts=parts, publish=self._publish)

    @hookimpl
    def on_gather_full_parameters(self, gather: bool) -> None:
        if self.units is None:
            return
        for unit in self.units.units:
            if unit.persistent:
                continue
            if gather:
                self.units.gather(unit)
            elif unit.gathered:
                self.units.free(unit)

    # ------------------------------------------------------------------ checkpoints

    @hookimpl
    def on_optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any] | None:
        if self.optimizers is None or optimizer not in self.optimizers:
            return None  # not an optimizer this sharder set up
        topology = self.shards.layout.topology
        if topology.tensor_parallel_size > 1 or topology.pipeline_parallel_size > 1:
            # Every tensor-parallel position's (every stage's) shards are needed: whole on every rank, DTensors
            # where split.
            return checkpoint.gathered_optimizer_state(self.shards, self.optimizers, optimizer)
        return checkpoint.consolidated_optimizer_state(self.shards, self.optimizers, optimizer)

    @hookimpl
    def on_load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: Mapping[str, Any]) -> bool:
        checkpoint.load_consolidated_optimizer_state(self.shards, self.optimizers, optimizer, state_dict)
        if self.offload is not None:
            self.offload.set_optimizer(optimizer)  # (the loaded state goes out again, bucket by bucket)
        return True

    @hookimpl
    def on_module_state_dict(self, module: nn.Module) -> dict[str, Any] | None:
        topology = self.shards.layout.topology
        if topology.tensor_parallel_size > 1 or topology.pipeline_parallel_size > 1:
            return None  # the strategy gathers a tensor-parallel or pipelined model whole
        return checkpoint.consolidated_module_state(self.shards, self.units, module)

    @hookimpl
    def on_local_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return checkpoint.local_module_state(self.shards, self.units, module)

    @hookimpl
    def on_local_optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any] | None:
        if self.optimizers is None or optimizer not in self.optimizers:
            return None
        return checkpoint.local_optimizer_state(self.shards, self.optimizers, optimizer)

    # ------------------------------------------------------------------ members that come and go

    def _sharded_ids(self) -> set[int]:
        return {id(p) for bucket in self.shards.buckets for p in bucket.params}

    @hookimpl
    def on_member_state(self, covers: set[int]) -> dict[str, Any]:
        # A returning member receives this rank's shards of the parameters from the same rank of a live one (1/k
        # of the model each on k ranks) instead of the module's: loaded before the optimizer steps, whose
        # all-gather then makes the module whole (stages 1-2), or the next forward gathers it (stage 3). The
        # optimizers' state is of the pieces already.
        covers.update(self._sharded_ids())
        return {"zero": [entry.shard.detach() for entry in self.shards.entries]}

    @hookimpl
    def on_load_member_state(self, state: Mapping[str, Any], covers: set[int]) -> None:
        covers.update(self._sharded_ids())
        with torch.no_grad():
            for entry, value in zip(self.shards.entries, state["zero"], strict=True):
                entry.shard.copy_(value)

    @hookimpl
    def on_member_unify(self, covers: set[int]) -> None:
        # On a member of several nodes the same local rank of every node holds the same shard and optimizer
        # pieces, which may have come from different live members: node 0's are taken.
        covers.update(self._sharded_ids())
        t = self.shards.layout.topology
        if t.num_nodes > 1:
            pieces = {id(piece) for pieces in self.optimizers.pieces_of.values() for piece in pieces}
            state = [v for o in self.optimizers.sharded for group in o.param_groups for p in group["params"]
                     if id(p) in pieces for v in o.state.get(p, {}).values() if isinstance(v, Tensor)]
            broadcast_coalesced([entry.shard for entry in self.shards.entries] + state, t.side_inter_node_group)

    # ------------------------------------------------------------------ metrics

    @hookimpl
    def on_collect_metrics(self) -> dict[str, float]:
        metrics = {}
        if self.in_backward is not None:
            metrics["zero/buckets_stepped_in_backward"], self.in_backward.count = float(self.in_backward.count), 0
        if self.offload is not None:
            metrics["zero/offload_buckets_stepped"], self.offload.buckets_stepped = (
                float(self.offload.buckets_stepped), 0)
            if isinstance(self.offload, DiskOffload):
                metrics["zero/offload_disk_MB"] = self.offload.bytes_on_disk / 1e6
        if self.units is not None:
            peak, self.units.peak_gathered_bytes = self.units.peak_gathered_bytes, self.shards.gathered_bytes()
            gathers, self.units.gathers = self.units.gathers, 0
            metrics.update({"zero/gathered_peak_MB": peak / 1e6, "zero/unit_gathers": float(gathers)})
        return metrics

    # ------------------------------------------------------------------ for tests and benchmarks

    @property
    def peak_gathered_bytes(self) -> int:
        """Stage 3: the most parameter bytes gathered at once since the last metrics collection (one step)."""
        return self.units.peak_gathered_bytes if self.units is not None else 0

    @property
    def fit_peak_gathered_bytes(self) -> int:
        """Stage 3: the same over the whole ``fit``."""
        return self.units.fit_peak_gathered_bytes if self.units is not None else 0

    @property
    def largest_unit_bytes(self) -> int:
        """Stage 3: bytes of the largest unit's gathered parameters."""
        return self.units.largest_unit_bytes if self.units is not None else 0
