"""What a returning replica group receives from a live peer: the module's, the optimizers' and the learning-rate
schedulers' state, the precision plugin's (a loss scaler's scale), and where the fit is (Lightning's step
counters), so that its next optimizer step is its peers'. Every other plugin hands over its own through the hooks
``on_member_state``/``on_load_member_state``: a sync mode the global copy, the outer optimizer and the schedule's
position (:class:`~ddp_plugin.fault_tolerance.sync.ReplicaGroupTransport`), a codec the state every rank shares, the
ZeRO sharder this rank's shards of the parameters (the same group rank of a peer holds the same shards, every group
having the same layout), which the module's state then leaves out (``covers``).

The optimizers' state goes as it is held, parameter by parameter in their groups' order (under ZeRO this rank's
pieces, whose layout is the peer's), with the groups' hyperparameters (the learning rate a scheduler set)."""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ddp_plugin.runtime import lightning_adapter
from ddp_plugin.runtime.comm import broadcast_coalesced
from ddp_plugin.hookspecs import is_tensor_parallel_shard, local_tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn
    from torch.optim import Optimizer

    from ddp_plugin.parallel.ties import Tie
    from ddp_plugin.sync.parts import Piece


def fit_state(module: pl.LightningModule, optimizers: list[Optimizer], skip: Collection[int] = ()) -> dict[str, Any]:
    """On a live peer, at the quorum of a step (before its optimizer step): references to the live tensors, which
    torchft's transport serializes before the peer's optimizer steps. The module's tensors whose ids are in
    ``skip`` (another part sends them) are left out."""
    trainer = module.trainer
    loop = trainer.fit_loop.epoch_loop
    return {
        "module": module_state(module, skip),
        "optimizers": [optimizer_state(lightning_adapter.unwrapped(o)) for o in optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
        "optimizer_steps": loop.automatic_optimization.optim_progress.optimizer.step.total.completed,
        "batches_that_stepped": lightning_adapter.batches_that_stepped(trainer),
        "epochs": trainer.fit_loop.epoch_progress.state_dict(),
    }


def load_fit_state(module: pl.LightningModule, optimizers: list[Optimizer], state: dict[str, Any],
                   skip: Collection[int] = ()) -> None:
    """On the returning group's ranks, inside the optimizer step (Lightning counted it ready, not completed)."""
    load_module_state(module, state["module"], skip)
    for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
        load_optimizer_state(lightning_adapter.unwrapped(optimizer), saved)
    load_position(module.trainer, state, in_step=True)


def load_position(trainer: pl.Trainer, state: dict[str, Any], in_step: bool) -> None:
    """Where a peer's fit was: its learning-rate schedulers, loss scaler and loop counters (``in_step``: loaded
    inside an optimizer step, which Lightning counted ready, not completed), its epoch number with them (both in
    an epoch: the next one shuffles its data as the peer's next does, and ``max_epochs`` ends them together)."""
    for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"]):
        config.scheduler.load_state_dict(saved)
    if state["precision"]:
        trainer.precision_plugin.load_state_dict(state["precision"])
    loop = trainer.fit_loop.epoch_loop
    total = loop.automatic_optimization.optim_progress.optimizer.step.total
    total.completed, total.ready = state["optimizer_steps"], state["optimizer_steps"] + int(in_step)
    lightning_adapter.set_batches_that_stepped(trainer, state["batches_that_stepped"])
    if "epochs" in state:
        trainer.fit_loop.epoch_progress.load_state_dict(state["epochs"])


def unify_group(module: pl.LightningModule, optimizers: list[Optimizer], skip: Collection[int],
                group: Any, tensor_parallel_group: Any = None, ties: Iterable[Tie] = ()) -> None:
    """On every rank of a group, at its first committed quorum: what every rank of the group holds whole (the
    module's tensors not in ``skip``, and the optimizers' state of those parameters), taken from the group's rank
    0 (the strategy's start-of-fit broadcast, over ``group``: the group's world).

    torchft heals each group rank from a live peer it picks for that rank, spreading the load over the groups:
    at the first quorum of a run, where every group but one heals and the groups may have started from
    different parameters, the ranks of one group may receive different groups' states (seen: rank 1 of group
    0 healed from group 1, rank 0 of group 1 from group 0). What a rank holds of its own (ZeRO's shards and optimizer
    pieces, a sync mode's part of the global copy, a codec's state) is then still the same on every group; what
    every rank holds whole differs inside a group, and is made one here. (A group that returns later heals every
    rank from groups that hold one replica.)

    With tensor parallelism ``group`` joins the ranks of this rank's tensor-parallel position (which hold the same
    shards), and the tensors every position holds whole (those ``parallelize_module`` left replicated) are then
    taken from the group's tensor-parallel rank 0, over ``tensor_parallel_group``. With pipeline stages each
    stage's ranks do the above, and the copies of a parameter several stages hold (``ties``: a tied embedding and
    head) take the first stage's, with their optimizer state and the step's gradient."""
    optimizers = [lightning_adapter.unwrapped(o) for o in optimizers]
    whole = [v for v in module.state_dict(keep_vars=True).values() if id(v) not in skip]
    take_from_first(whole, optimizers, group)
    if tensor_parallel_group is not None:
        take_from_first([v for v in whole if not is_tensor_parallel_shard(v)], optimizers, tensor_parallel_group)
    for tie in ties:
        if tie.param is not None and id(tie.param) not in skip:
            # (and the step's gradient: each copy's was averaged over the groups on its own rank's torchft group,
            # from which torchft healed another group at this first quorum)
            take_from_first([tie.param], optimizers, tie.group,
                            [tie.param.grad] if tie.param.grad is not None else [])


def take_from_first(tensors: list[torch.Tensor], optimizers: list[Optimizer], group: Any,
                    extra: list[torch.Tensor] = ()) -> None:
    """``tensors``, the ``optimizers``' state of them and ``extra`` take their values on ``group``'s first rank (in
    place; a DTensor's local part). Collective over ``group``, whose ranks pass tensors of the same shapes."""
    every = list(tensors) + state_tensors(optimizers, {id(t) for t in tensors}) + list(extra)
    broadcast_coalesced([local_tensor(t) for t in every], group)


def state_tensors(optimizers: list[Optimizer], ids: Collection[int]) -> list[torch.Tensor]:
    """The optimizers' state tensors of the parameters whose ids are in ``ids``, in the same order on every rank
    that holds the same parameters."""
    return [v for o in optimizers for group in o.param_groups for p in group["params"] if id(p) in ids
            for v in o.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def module_state(module: nn.Module, skip: Collection[int]) -> dict[str, Any]:
    """The module's state dict (references), less the tensors whose ids are in ``skip``; a tensor-parallel shard as
    its local part (the same group rank of every group holds the same shard)."""
    return {k: local_tensor(v).detach() for k, v in module.state_dict(keep_vars=True).items() if id(v) not in skip}


def load_module_state(module: nn.Module, state: dict[str, Any], skip: Collection[int]) -> None:
    """Load :func:`module_state`'s ``state`` in place: exactly the tensors not in ``skip`` must be given."""
    own = {k: v for k, v in module.state_dict(keep_vars=True).items() if id(v) not in skip}
    if set(own) != set(state):
        raise RuntimeError(f"replica groups: a live peer's module state does not match this group's (keys only"
                           f" here: {sorted(set(own) - set(state))}, only there: {sorted(set(state) - set(own))});"
                           " every group must build the same model")
    with torch.no_grad():
        for key, value in own.items():
            local_tensor(value).copy_(state[key])


def optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state as it is held: per parameter of its groups, in order, and the groups'
    hyperparameters (its own ``state_dict()`` is refused under ZeRO, whose pieces it holds)."""
    return {"state": [{k: local_tensor(v) if isinstance(v, torch.Tensor) else v
                       for k, v in optimizer.state.get(p, {}).items()}
                      for group in optimizer.param_groups for p in group["params"]],
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]}


def load_optimizer_state(optimizer: Optimizer, saved: dict[str, Any]) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(saved["state"]) or len(optimizer.param_groups) != len(saved["groups"]):
        raise RuntimeError("replica groups: a live peer's optimizer holds other parameters than this group's; every"
                           " group must build the same model and optimizer")
    optimizer.state.clear()
    for p, state in zip(params, saved["state"]):
        if state:
            optimizer.state[p] = {k: _like(p, v) if isinstance(v, torch.Tensor) and k != "step" else v
                                  for k, v in state.items()}
    for group, hyper in zip(optimizer.param_groups, saved["groups"]):
        group.update(hyper)


def _like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """An optimizer's state tensor of ``p`` from its local part: on ``p``'s device, and where ``p`` is a DTensor
    (a tensor-parallel shard, or a tensor ``parallelize_module`` replicated) and the value has its local shape
    (its moments), a DTensor placed as ``p``."""
    from torch.distributed.tensor import DTensor

    value = value.to(p.device)
    if isinstance(p, DTensor) and value.shape == local_tensor(p).shape:
        return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return value


# ---------------------------------------------------------------------- a group joining between syncs


def synced_fit_state(module: pl.LightningModule, optimizers: list[Optimizer]) -> dict[str, Any]:
    """On a live peer, at the start of the first step after a sync is sent: the fit's position then (its
    learning-rate schedulers, loss scaler, loop counters, the optimizers' hyperparameters), and copies of the
    module's buffers; small, copied (the step about to run changes them). The frozen parameters are served as
    they are (nothing changes them)."""
    trainer = module.trainer
    loop = trainer.fit_loop.epoch_loop
    return {
        "schedulers": [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs],
        "precision": copy.deepcopy(trainer.precision_plugin.state_dict()),
        "optimizer_steps": loop.automatic_optimization.optim_progress.optimizer.step.total.completed,
        "batches_that_stepped": lightning_adapter.batches_that_stepped(trainer),
        "epochs": copy.deepcopy(trainer.fit_loop.epoch_progress.state_dict()),
        "groups": [[{k: v for k, v in group.items() if k != "params"} for group in lightning_adapter.unwrapped(o).param_groups]
                   for o in optimizers],
        "buffers": {name: local_tensor(b).detach().clone() for name, b in module.named_buffers()},
    }


def sync_module_state(module: nn.Module, synced: dict[str, Any], skip: Collection[int]) -> dict[str, Any]:
    """The module's tensors not in ``skip`` a group joining between syncs receives: the buffers as copied at the last
    sync (``synced["buffers"]``), the other tensors (frozen parameters) as they are."""
    buffers = synced["buffers"]
    return {k: buffers[k] if k in buffers else local_tensor(v).detach()
            for k, v in module.state_dict(keep_vars=True).items() if id(v) not in skip}


def load_synced_fit_state(module: pl.LightningModule, optimizers: list[Optimizer], state: dict[str, Any],
                          skip: Collection[int]) -> None:
    """On a group joining between syncs, before its first step: the module's tensors ``sync_module_state`` gave,
    the position of :func:`synced_fit_state`; the optimizers' state starts afresh (a group's inner moments are
    its own, as its pseudo-gradients are), with the peer's hyperparameters (the learning rate its scheduler set)."""
    load_module_state(module, state["module"], skip)
    fit = state["fit"]
    for optimizer, groups in zip(optimizers, fit["groups"], strict=True):
        optimizer = lightning_adapter.unwrapped(optimizer)
        optimizer.state.clear()
        for group, hyper in zip(optimizer.param_groups, groups, strict=True):
            group.update(hyper)
    load_position(module.trainer, fit, in_step=False)


def advance_fit(module: pl.LightningModule, steps: int) -> None:
    """Inside an optimizer step: the fit's counters and its per-step learning-rate schedulers moved ``steps``
    optimizer steps on (a group that joined its peers' sync before its own schedule's takes their position)."""
    trainer = module.trainer
    loop = trainer.fit_loop.epoch_loop
    total = loop.automatic_optimization.optim_progress.optimizer.step.total
    base = lightning_adapter.batches_that_stepped(trainer)
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step" and not config.reduce_on_plateau:
            for i in range(steps):
                if (base + i + 1) % config.frequency == 0:
                    config.scheduler.step()
    total.completed += steps
    total.ready += steps
    lightning_adapter.set_batches_that_stepped(trainer, base + steps)


def unify_tie(sync: Any, tie: Tie) -> None:
    """With pipeline stages, at a sync mode's first committed sync (``sync``: the
    :class:`~ddp_plugin.fault_tolerance.sync.ReplicaGroupTransport`): the global copy and outer state of a tied
    parameter's copy (the embedding's on the first stage, the head's on the last), taken from the first stage's
    (torchft may heal each group rank from another group at that first quorum). Each stage holds its copy elsewhere in its buckets, so the ranks of a node cut it into other parts on each stage: each rank
    puts its elements into buffers of the whole parameter, the node's ranks of the stage sum them (every
    element from the one rank holding it), the first stage's are broadcast over the tie's group, and each rank
    takes its elements back. (One fragment: the whole parameter is synced at once on every stage.)"""
    b = next(i for i, bucket in enumerate(sync.buckets) if any(p is tie.param for p in bucket.params))
    bucket = sync.buckets[b]
    start = bucket.offsets[next(i for i, p in enumerate(bucket.params) if p is tie.param)]
    n = local_tensor(tie.param).numel()
    spans = [(p, max(p.lo, start), min(p.hi, start + n)) for p in sync.pieces
             if p.bucket == b and p.lo < start + n and p.hi > start]
    keys = sorted({k for p in sync.pieces for k, v in sync.outer.state.get(p.outer, {}).items()
                   if isinstance(v, torch.Tensor) and v.shape == p.outer.shape})
    whole = torch.zeros((1 + len(keys), n), dtype=tie.param.dtype, device=sync.topology.device)

    def held(piece: Piece) -> list[torch.Tensor]:
        state = sync.outer.state.get(piece.outer, {})
        return [piece.outer.detach()] + [state[k] for k in keys]

    for piece, lo, hi in spans:
        for row, values in zip(whole, held(piece)):
            row[lo - start : hi - start].copy_(values[lo - piece.lo : hi - piece.lo])
    if sync.topology.ranks_per_node > 1:
        sync.comm.all_reduce(whole, group=sync.intra)
    broadcast_coalesced([whole], tie.group)
    with torch.no_grad():
        for piece, lo, hi in spans:
            for row, values in zip(whole, held(piece)):
                values[lo - piece.lo : hi - piece.lo].copy_(row[lo - start : hi - start])
