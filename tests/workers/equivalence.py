"""Worker for the C1/C2 tests: trains one small model under several configurations and saves what happened.

    python tests/workers/equivalence.py --out DIR --devices 4 [--devices-per-node 2]   # distributed
    python tests/workers/equivalence.py --out DIR --devices 0                          # single-process reference

The distributed run uses `global_batch / devices` samples per rank; the reference uses one process and the
whole global batch, so each optimizer step sees the same samples in both (a DistributedSampler without
shuffling hands rank r the samples r, r+N, ..., whose union per step is one contiguous block).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.callbacks import ParameterHistory
from ddp_plugin.testing.data import rank_loader
from ddp_plugin.testing.processes import run_each

GLOBAL_BATCH = 16
STEPS = 20
BRANCH_THRESHOLD = 1.5

CONFIGS = {
    "plain": dict(optimizer="adamw"),
    "accumulate": dict(optimizer="adamw", accumulate=2),
    "clip_and_schedule": dict(optimizer="sgd", clip=0.05, scheduler=True),
    "everything": dict(optimizer="adamw", accumulate=3, clip=0.05, scheduler=True),
    "sgd_schedule": dict(optimizer="sgd", scheduler=True),
}


class Branch(nn.Linear):
    """Its own class, so a stage 3 policy of ``["Linear"]`` leaves it out of the units: only some ranks call it,
    and every rank must gather the same units in the same order (as with FSDP and DeepSpeed stage 3)."""


class Net(L.LightningModule):
    """A tiny model with a frozen layer, a tied weight, and a branch that only samples with x[0] > threshold use
    (its bias gets no gradient on steps where no rank's samples take the branch): the cases C1 and C2 must hold
    for, which :class:`~ddp_plugin.testing.models.TinyModule` around a plain MLP does not have."""

    def __init__(self, optimizer: str, scheduler: bool = False, accumulate: int = 1) -> None:
        super().__init__()
        self.accumulate = accumulate
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.embed = nn.Linear(8, 32)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.branch = Branch(32, 32)
        self.head = nn.Linear(32, 1)
        # Tied: the branch shares its weight with the body's layer (one parameter, two modules).
        self.branch.weight = self.body[1].weight
        self.branch_used: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.frozen(self.embed(x)))
        mask = x[:, 0] > BRANCH_THRESHOLD
        self.branch_used.append(bool(mask.any()))
        if mask.any():
            h = h + self.branch(h) * mask[:, None]
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        # No shuffling, so rank r's batch j together with the other ranks' is the reference's batch j.
        return rank_loader(dataset(self.accumulate), GLOBAL_BATCH, self.trainer.world_size, self.trainer.global_rank)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=5e-2, momentum=0.9, weight_decay=0.01)
        if not self.use_scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)}


def dataset(accumulate: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    n = GLOBAL_BATCH * STEPS * accumulate
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def run(name: str, devices: int, devices_per_node: int | None, hierarchical: bool | None, out: str,
        num_nodes: int = 1, zero: dict | None = None, precision: str = "32-true", tag: str = "",
        accelerator: str = "cpu") -> None:
    cfg = CONFIGS[name]
    accumulate = cfg.get("accumulate", 1)
    L.seed_everything(1234, verbose=False)
    model = Net(cfg["optimizer"], cfg.get("scheduler", False), accumulate)
    if devices:
        # A 1 KiB bucket cap puts every parameter in a bucket of its own: many buckets, launched in order.
        strategy = HierarchicalZeroStrategy(
            bucket_size_mb=1 / 1024, devices_per_node=devices_per_node, hierarchical=hierarchical, **(zero or {})
        )
        trainer_devices = devices
    else:
        strategy, trainer_devices = "auto", 1
    recorder, stepped = ParameterHistory(), SteppedInBackward()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=trainer_devices,
        num_nodes=num_nodes if devices else 1,
        strategy=strategy,
        max_steps=STEPS,
        precision=precision,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=cfg.get("clip"),
        callbacks=[recorder, stepped],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    if stepped.offload_dir is not None:
        # Listed once every rank is past its teardown (a rank still in it may be between making a file and
        # unlinking it): what is left behind.
        if trainer.world_size > 1:
            trainer.strategy.barrier()
        stepped.files = sorted(os.listdir(stepped.offload_dir))

    used = torch.tensor(model.branch_used, dtype=torch.int32)
    if trainer.world_size > 1:
        used = trainer.strategy.all_gather(used)  # (ranks, micro-batches)
    if trainer.is_global_zero:
        torch.save(
            {
                "history": torch.stack(recorder.history),
                "max_rank_diff": recorder.max_rank_diff,
                "branch_used": used,
                "world_size": trainer.world_size,
                "hierarchical": trainer.strategy.uses_hierarchical_reducer if devices else False,
                "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
                "device": recorder.device,
                "stepped_in_backward": stepped.total,
                "offload_stepped": stepped.offloaded,
                "offload_files": stepped.files,
                "state_in_files": stepped.state_in_files,
            },
            os.path.join(out, f"{name}-{devices}{tag}.pt"),
        )


class SteppedInBackward(L.Callback):
    """How many buckets ``optimizer_in_backward`` stepped in backward over the fit (None without it)."""

    total: int | None = None
    offloaded: float | None = None
    """Buckets the offload stepped (in backward or after it) over the fit (None without offload)."""
    files: list[str] | None = None
    """What ``offload_dir`` holds at the end (nothing: the files are unlinked once mapped)."""
    offload_dir: str | None = None
    state_in_files: tuple[int, int] | None = None
    """Optimizer state entries (per piece and key) in the offload's mapped files, and entries in all."""


    def on_train_end(self, trainer, pl_module) -> None:
        manager = getattr(trainer.strategy, "plugin_manager", None)
        sharder = manager.get_plugin("zero_sharder") if manager is not None else None
        in_backward = getattr(sharder, "in_backward", None)
        self.total = in_backward.total if in_backward is not None else None
        offload = getattr(sharder, "offload", None)
        self.offloaded = None if offload is None else trainer.strategy.metric_totals["zero/offload_buckets_stepped"]
        if offload is not None and hasattr(offload, "directory"):
            self.offload_dir = offload.directory
            self.state_in_files = state_in_mapped_files(trainer.optimizers[0], sharder)


def state_in_mapped_files(optimizer, sharder) -> tuple[int, int]:
    """How many of the pieces' optimizer state tensors lie in a mapping of an offload file (from the kernel's
    list of this process's mappings: unlinked files show as ``(deleted)``), and how many there are."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "ddp_plugin_offload_" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                spans.append((lo, hi))
    inside = total = 0
    for entry in sharder.shards.entries:
        for piece in entry.pieces:
            for value in optimizer.state.get(piece.param, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += 1
                    inside += any(lo <= value.data_ptr() < hi for lo, hi in spans)
    if sharder.offload.params:  # the stage-3 units' parameter shards too
        for entry in sharder.shards.entries:
            if entry.full.untyped_storage().data_ptr() != entry.shard.untyped_storage().data_ptr():
                total += 1
                inside += any(lo <= entry.shard.data_ptr() < hi for lo, hi in spans)
    return inside, total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--devices-per-node", type=int, default=None)
    parser.add_argument("--num-nodes", type=int, default=1, help="real nodes (e.g. torchrun on a simulated cluster)")
    parser.add_argument("--hierarchical", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--variants", default="0:global:auto",
                        help="comma-separated zero_stage:shard_scope:hierarchical[:inbw][:disk[:params]|:cpu] runs, one"
                        " after the other in the same processes (hierarchical: auto, on or off; inbw:"
                        " optimizer_in_backward=True; disk: offload='disk', params: offload_params;"
                        " cpu: offload='cpu')")
    parser.add_argument("--wrap", default="Linear", help="stage 3 auto_wrap_policy: module class names, comma-separated")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu for the CUDA/NCCL tests")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for variant in args.variants.split(","):
        stage, scope, hier, *more = variant.split(":")  # (more: "inbw", optimizer_in_backward)
        zero = {"zero_stage": int(stage), "shard_scope": scope, "optimizer_in_backward": "inbw" in more}
        # (more: "disk", offload="disk" in OUT/offload; "params", its offload_params=True; "cpu", offload="cpu")
        if "disk" in more:
            zero.update(offload="disk", offload_dir=os.path.join(args.out, "offload"), offload_params="params" in more)
        elif "cpu" in more:
            zero["offload"] = "cpu"
        if int(stage) == 3:
            zero["auto_wrap_policy"] = args.wrap.split(",")
        # A variant's own hierarchical setting wins over --hierarchical; the default variant keeps the plain
        # file names of the stage 0 tests.
        hierarchical = {"auto": None, "on": True, "off": False}[hier if hier != "auto" else args.hierarchical]
        tag = "" if variant == "0:global:auto" else "-" + variant.replace(":", "-")
        for name in args.configs.split(","):
            run(name, args.devices, args.devices_per_node, hierarchical, args.out, args.num_nodes,
                zero if args.devices else None, args.precision, tag, args.accelerator)


if __name__ == "__main__":
    run_each(main)
