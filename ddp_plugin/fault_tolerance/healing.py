"""What a returning replica group receives from a live peer: the module's, the optimizers' and the learning-rate
schedulers' state, the precision plugin's (a loss scaler's scale), and where the fit is (Lightning's step
counters), so that its next optimizer step is its peers'. A sync mode adds its own (the global copy, the outer
optimizer, the schedule's position: :class:`~ddp_plugin.fault_tolerance.sync.ReplicaGroupSync`), a codec the state
every rank shares (:func:`heal_codec`). (The sharders, whose state would also belong here, are refused with
``fault_tolerance`` for now.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

    from ddp_plugin.codecs.base import Codec
    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups


def fit_state(module: pl.LightningModule, optimizers: list[Optimizer]) -> dict[str, Any]:
    """On a live peer, at the quorum of a step (before its optimizer step): references to the live tensors, which
    torchft's transport serializes before the peer's optimizer steps."""
    trainer = module.trainer
    loop = trainer.fit_loop.epoch_loop
    return {
        "module": module.state_dict(),
        "optimizers": [getattr(o, "_optimizer", o).state_dict() for o in optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
        "optimizer_steps": loop.automatic_optimization.optim_progress.optimizer.step.total.completed,
        "batches_that_stepped": loop._batches_that_stepped,
    }


def load_fit_state(module: pl.LightningModule, optimizers: list[Optimizer], state: dict[str, Any]) -> None:
    """On the returning group's ranks, inside the optimizer step (Lightning counted it ready, not completed)."""
    module.load_state_dict(state["module"])
    for optimizer, saved in zip(optimizers, state["optimizers"]):
        getattr(optimizer, "_optimizer", optimizer).load_state_dict(saved)
    trainer = module.trainer
    for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"]):
        config.scheduler.load_state_dict(saved)
    if state["precision"]:
        trainer.precision_plugin.load_state_dict(state["precision"])
    loop = trainer.fit_loop.epoch_loop
    total = loop.automatic_optimization.optim_progress.optimizer.step.total
    total.completed, total.ready = state["optimizer_steps"], state["optimizer_steps"] + 1
    loop._batches_that_stepped = state["batches_that_stepped"]


def heal_codec(replicas: ReplicaGroups, codec: Codec) -> None:
    """A returning group also receives the codec's state that every rank shares (PowerSGD's Q and its count of
    steps, which decides when compression starts), so that its collectives are its peers' from its first step on.
    Its per-rank state (error-feedback residuals) starts from zero, as on a resume with another world size.

    Read on a live peer at the quorum of a step whose codec does not run (a group heals in it: the cross stage is
    then torchft's plain all-reduce), so the states are as the last committed step left them."""

    def state() -> dict[Any, Any]:
        return {key: s.state_dict() for key, s in codec.states.items()}

    def load(saved: dict[Any, Any]) -> None:
        codec.states = {}
        for key, shared in saved.items():
            restored = codec.states[key] = codec.State(shared["numel"])
            restored.load_state_dict(shared)

    replicas.add_state("codec", state, load)
