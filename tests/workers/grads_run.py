"""Worker for the tests of gradients in user hooks at ZeRO stages (tests/test_zero_gradients.py).

    python tests/workers/grads_run.py --mode hooks --out DIR --devices 2 [--devices-per-node 2] \
        --config norm --runs ddp,0:global:auto,1:global:auto,2:global:auto,2:global:auto:quiet
    python tests/workers/grads_run.py --mode traffic --out DIR --devices 4 --devices-per-node 2 --runs ...

Every run trains the same tiny model on the same data, one after the other in one launch; ``ddp`` is Lightning's
own ``DDPStrategy``, ``stage:scope:hierarchical`` is ``HierarchicalZeroStrategy`` (``:quiet`` reads no gradient).

``hooks``: what user hooks see. ``on_after_backward`` and ``on_train_batch_end`` record every parameter's
``.grad``; ``on_before_optimizer_step`` records ``lightning.pytorch.utilities.grad_norm(self, 2)``, the
strategy's ``grad_norm(2)`` and, at stages 2-3, the gradient bytes before, inside and after
``strategy.full_gradients()``. At stages 0-1 ``.grad`` is read directly, at stages 2-3 inside
``full_gradients()``. Global rank 0 saves ``{config}-{run}.pt``.

``traffic``: a larger model (width 256), plain SGD; per optimizer step, each rank's cross-node bytes (from the
strategy's traffic accounting) and the padded gradient size; ``:helper`` gathers the full gradients every step.
"""

from __future__ import annotations

import argparse
import contextlib

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.data import rank_loader, sine_dataset
from ddp_plugin.testing.models import TinyModule, mlp

GLOBAL_BATCH = 8
STEPS = 4
CONFIGS = {
    # AdamW, gradient accumulation over 2 batches, clipping to a global 2-norm of 0.05.
    "norm": dict(optimizer="adamw", accumulate=2, clip=0.05, algorithm="norm"),
    # SGD with momentum, every gradient element clipped to [-0.01, 0.01].
    "value": dict(optimizer="sgd", accumulate=1, clip=0.01, algorithm="value"),
}


class Net(L.LightningModule):
    """Three Linear layers (each a stage 3 unit), the middle one frozen: its ``.grad`` stays None everywhere.
    Its own class (not :class:`~ddp_plugin.testing.models.TinyModule` with a callback): what is under test is what
    the LightningModule's *own* hooks see of ``.grad``, ``grad_norm(self)`` and ``self.log_dict``."""

    def __init__(self, optimizer: str, observe: bool, width: int = 8) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.observe = observe
        self.inp = nn.Linear(4, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(width, 1)
        self.record: dict[str, list] = {"after_backward": [], "batch_end": [], "grad_norm": [], "strategy_grad_norm": [],
                                        "memory": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.frozen(torch.tanh(self.inp(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=5e-2, momentum=0.9)

    # ------------------------------------------------------------------ what the tests look at

    def _full(self):
        """At stages 2-3 the gradients are gathered on demand; at stages 0-1 `.grad` is read as it is."""
        strategy = self.trainer.strategy
        if isinstance(strategy, HierarchicalZeroStrategy) and strategy.zero_stage >= 2:
            return strategy.full_gradients()
        return contextlib.nullcontext()

    def _grads(self) -> dict[str, torch.Tensor | None]:
        return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in self.named_parameters()}

    def on_after_backward(self) -> None:
        if self.observe:
            with self._full():
                self.record["after_backward"].append(self._grads())

    def on_before_optimizer_step(self, optimizer) -> None:
        if not self.observe:
            return
        strategy = self.trainer.strategy
        sharded = isinstance(strategy, HierarchicalZeroStrategy) and strategy.zero_stage >= 2
        before = strategy.memory_bytes()["grads"] if sharded else 0
        with self._full():
            inside = strategy.memory_bytes()["grads"] if sharded else 0
            norms = grad_norm(self, norm_type=2)
        after = strategy.memory_bytes()["grads"] if sharded else 0
        self.log_dict(norms)
        self.record["grad_norm"].append({k: float(v) for k, v in norms.items()})
        self.record["memory"].append((before, inside, after))
        if isinstance(strategy, HierarchicalZeroStrategy):
            self.record["strategy_grad_norm"].append({k: float(v) for k, v in strategy.grad_norm(2).items()})

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.observe:
            with self._full():
                self.record["batch_end"].append(self._grads())


class CrossNodePerStep(L.Callback):
    """Each step's cross-node bytes (the strategy's traffic accounting) and the padded gradient size; with
    ``helper``, the full gradients are gathered (``strategy.full_gradients()``) before every optimizer step."""

    def __init__(self, helper: bool) -> None:
        self.helper = helper
        self.cross_node: list[float] = []
        self.gradient_bytes = 0
        self._last_total = 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.helper:
            with trainer.strategy.full_gradients():
                grad_norm(pl_module, 2)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        self.gradient_bytes = sum(b.nbytes for b in strategy.engine.buckets)
        total = strategy.metric_totals.get("comm/cross_node_MB", 0.0) * 1e6
        self.cross_node.append(total - self._last_total)
        self._last_total = total


class Data(L.LightningDataModule):
    """Rank r gets samples r, r + N, ... in order: each step's union over ranks is the same for every strategy."""

    def __init__(self, dataset: TensorDataset) -> None:
        super().__init__()
        self.dataset = dataset

    def train_dataloader(self) -> DataLoader:
        return rank_loader(self.dataset, GLOBAL_BATCH, self.trainer.world_size, self.trainer.global_rank)


def strategy_for(run: str, devices_per_node: int | None):
    if run == "ddp":
        return DDPStrategy()
    stage, scope, hier = run.split(":")[:3]
    return HierarchicalZeroStrategy(
        zero_stage=int(stage), shard_scope=scope, hierarchical={"on": True, "off": False, "auto": None}[hier],
        devices_per_node=devices_per_node, auto_wrap_policy=[nn.Linear],
        bucket_size_mb=1 / 4096,  # 256 bytes: a bucket per tensor, some of them smaller than the world
    )


def trainer_for(run: str, args, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy_for(run, args.devices_per_node),
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False, **kwargs)


def hooks(run: str, args) -> None:
    cfg = CONFIGS[args.config]
    L.seed_everything(1234, verbose=False)
    model = Net(cfg["optimizer"], observe=not run.endswith(":quiet"))
    dataset = sine_dataset(GLOBAL_BATCH * STEPS * cfg["accumulate"], 4, seed=7)
    trainer = trainer_for(run, args, max_steps=STEPS, accumulate_grad_batches=cfg["accumulate"],
                          gradient_clip_val=cfg["clip"], gradient_clip_algorithm=cfg["algorithm"])
    trainer.fit(model, datamodule=Data(dataset))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if trainer.is_global_zero:
        torch.save({**model.record, "params": params}, f"{args.out}/{args.config}-{run.replace(':', '-')}.pt")


def traffic(run: str, args) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyModule(mlp(256, 256, 1), optimizer="sgd", lr=1e-3)
    recorder = CrossNodePerStep(helper=run.endswith(":helper"))
    trainer = trainer_for(run, args, max_steps=5, callbacks=[recorder])
    trainer.fit(model, datamodule=Data(sine_dataset(GLOBAL_BATCH * 5, 256, seed=7)))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, recorder.cross_node)
    if trainer.is_global_zero:
        torch.save({"cross_node": every, "gradient_bytes": recorder.gradient_bytes},
                   f"{args.out}/traffic-{run.replace(':', '-')}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["hooks", "traffic"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--devices-per-node", type=int, default=None)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="norm")
    parser.add_argument("--runs", required=True, help="comma-separated: ddp or stage:scope:hierarchical[:quiet]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs.split(","):
        (hooks if args.mode == "hooks" else traffic)(run, args)


if __name__ == "__main__":
    main()
