"""Worker for the pipeline tests: trains the tiny tied-embedding GPT (``ddp_plugin.testing.gpt``) with pipeline
stages and saves the consolidated parameters (global rank 0 gathers every stage's through the strategy's
checkpoint path), how far the data-parallel replicas and the copies of the tied embedding ever were apart, and
the logged losses.

    python tests/workers/pp_run.py --out DIR --devices 2 --reference              # Lightning ddp, 2 ranks
    python tests/workers/pp_run.py --out DIR --devices 4 --pp 2 --variants 1f1b,gpipe,interleaved_1f1b
    python tests/workers/pp_run.py --out DIR --devices 8 --devices-per-node 4 --pp 2 --tp 2 --variants 1f1b

A variant is ``schedule[:stage[:codec]]``. Every run sees the same global batch per step: data-parallel rank r of N
gets samples r, r + N, ... in order (the stages and tensor-parallel ranks of one data-parallel rank read the same).
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.hookspecs import hookimpl, local_tensor
from ddp_plugin.parallel.tensor_parallel import full_state_dict
from ddp_plugin.testing.callbacks import SaveAt
from ddp_plugin.testing.data import rank_loader
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.processes import run_each
from ddp_plugin.testing.ranks import max_group_difference

GLOBAL_BATCH = 8
STEPS = 8
EPOCH = 2  # steps per epoch: checkpoints are saved at an epoch's end (step 4), Lightning's every 2 epochs
CLIP = 0.3  # binds on every step (see tp_run)


class Checks(L.Callback):
    """After every optimizer step: the largest difference of each rank's local parameters from its stage's first
    rank (data-parallel replicas; for split parameters, their data-parallel replicas), and of the tied embedding's
    copies between the first and the last stage. Also every step's loss as the strategy returned it."""

    def __init__(self) -> None:
        self.max_replica_diff = 0.0
        self.max_tie_diff = 0.0
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # The reference's gradient norm before clipping (Lightning clips after this hook): clipping must bind.
        if not isinstance(trainer.strategy, HierarchicalZeroStrategy):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        strategy = trainer.strategy
        if not isinstance(strategy, HierarchicalZeroStrategy):
            return
        groups = strategy.fit.groups
        dp_group = groups.topology.world_group
        with strategy.full_parameters():
            params = list(pl_module.parameters())
            split = [local_tensor(p) for p in params if local_tensor(p) is not p]
            plain = [p for p in params if local_tensor(p) is p]
            self.max_replica_diff = max(self.max_replica_diff, max_group_difference(split, dp_group),
                                        max_group_difference(plain, groups.bookkeeping))
            for tie in strategy.fit.pipeline.ties if strategy.fit.pipeline is not None else ():
                if tie.param is not None:
                    self.max_tie_diff = max(self.max_tie_diff,
                                            max_group_difference([local_tensor(tie.param)], tie.group))


class GPTWithValidation(GPTModule):
    def __init__(self, *args, scheduler: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler = scheduler

    def validation_step(self, batch, batch_idx) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self.model(x), y))

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5), "interval": "step"}}


class NanAt(L.Callback):
    """At optimizer step ``step``, global rank 2 (a rank of the last stage) gets a NaN gradient: one rank of one
    stage sees it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_fit_start(self, trainer, pl_module) -> None:
        def poison(grad):
            return grad * float("nan") if trainer.global_rank == 2 and trainer.global_step == self.step else grad

        next(p for p in pl_module.parameters()).register_hook(poison)


class TiedSums:
    """A plugin that counts the elements of the tied gradients' sums this rank sends through the codec (the bucket
    kind ``"tied_gradient"`` of ``on_cross_node_reduce``), over the whole fit."""

    def __init__(self) -> None:
        self.elements = 0

    @hookimpl(wrapper=True)
    def on_cross_node_reduce(self, tensor, bucket):
        if bucket.kind == "tied_gradient":
            self.elements += tensor.numel()
        return (yield)


def run(out: str, devices: int, devices_per_node: int | None, tag: str, flags: dict | None, reference: bool,
        layers: int, accumulate: int = 1, save_at: int = 0, resume: str | None = None, uneven: bool = False,
        nan_at: int = -1, scheduler: bool = False, blocks: str = "list") -> None:
    L.seed_everything(1234, verbose=False)
    model = GPTWithValidation(layers=layers, scheduler=scheduler, blocks=blocks)
    initial = {n: p.detach().clone() for n, p in model.state_dict().items()}
    tied_sums = TiedSums()
    strategy: object = "ddp" if reference else HierarchicalZeroStrategy(
        devices_per_node=devices_per_node, bucket_size_mb=1 / 256, plugins=[tied_sums],
        **{"hierarchical": True, **(flags or {})})
    checks = Checks()
    callbacks: list[L.Callback] = [checks]
    if save_at:
        callbacks.append(SaveAt(save_at, os.path.join(out, f"{tag}-step{save_at}.ckpt")))
    if nan_at >= 0:
        callbacks.append(NanAt(nan_at))
    if scheduler:  # and Lightning's own checkpoint callback
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(os.path.join(out, f"{tag}-callback"), save_top_k=-1,
                                                             every_n_train_steps=2 * EPOCH))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS,
                        gradient_clip_val=CLIP, callbacks=callbacks, logger=False, enable_checkpointing=scheduler,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        accumulate_grad_batches=accumulate, check_val_every_n_epoch=2, num_sanity_val_steps=0)
    data = token_dataset(GLOBAL_BATCH * EPOCH * accumulate)
    held_out = token_dataset(GLOBAL_BATCH * 2, seed=1)

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            kwargs = trainer.strategy.distributed_sampler_kwargs
            if uneven:  # of each step's global batch, data-parallel rank 0 reads the first 3 samples, rank 1 the 5 after
                assert kwargs["num_replicas"] == 2
                lo, hi = (0, 3) if kwargs["rank"] == 0 else (3, GLOBAL_BATCH)
                return DataLoader(data, batch_sampler=[list(range(s * GLOBAL_BATCH + lo, s * GLOBAL_BATCH + hi))
                                                       for s in range(len(data) // GLOBAL_BATCH)])
            return rank_loader(data, GLOBAL_BATCH, kwargs["num_replicas"], kwargs["rank"])

        def val_dataloader(self):
            kwargs = trainer.strategy.distributed_sampler_kwargs
            return rank_loader(held_out, GLOBAL_BATCH, kwargs["num_replicas"], kwargs["rank"])

    trainer.fit(model, datamodule=Data(), ckpt_path=resume)
    strategy = trainer.strategy
    if getattr(getattr(strategy, "fit", None), "pipeline", None) is not None and strategy.config.checkpoint == "sharded":
        # (a sharded run's state dict is each rank's own: every stage's, as the master checkpoint gathers them)
        with strategy.full_parameters():
            state = {k: v.detach().clone() for k, v in full_state_dict(model.state_dict()).items()}
        state = strategy.fit.pipeline.checkpoint.gather_module_state(state)
    else:
        state = strategy.lightning_module_state_dict()
    # every rank's cross-node bytes by our accounting (a stage's sends, the tied sum), over the whole fit
    cross_node = [None] * dist.get_world_size()
    dist.all_gather_object(cross_node, getattr(strategy, "metric_totals", {}).get("comm/cross_node_MB"))
    tied_elements = [None] * dist.get_world_size()
    dist.all_gather_object(tied_elements, tied_sums.elements)
    if trainer.is_global_zero:
        torch.save({
            "state": {k: v.detach().clone() for k, v in state.items()},
            "tied_in_state": state["model.head.weight"] is state["model.tok.weight"]
            or state["model.head.weight"].untyped_storage().data_ptr() == state["model.tok.weight"].untyped_storage().data_ptr(),
            "initial": initial,
            "max_replica_diff": checks.max_replica_diff,
            "max_tie_diff": checks.max_tie_diff,
            "losses": checks.losses,
            "grad_norms": checks.grad_norms,
            "logged_loss": float(trainer.callback_metrics["train_loss"]),
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "sampler": trainer.strategy.distributed_sampler_kwargs,
            "skipped_steps": getattr(trainer.strategy, "skipped_steps", 0),
            # stage 3: units gathered per step (the metric's mean), and the units there are to gather
            "unit_gathers": getattr(strategy, "metric_means", {}).get("zero/unit_gathers"),
            "units": _units(strategy),
            "compression_ratio": getattr(strategy, "metric_means", {}).get("comm/compression_ratio"),
            "hierarchical": getattr(trainer.strategy, "uses_hierarchical_reducer", False),
            # the codec's per-bucket state (error feedback, PowerSGD's matrices) by key: "tied_gradient/<i>" where
            # the sum of a tie's copies went through it
            "codec_keys": sorted(str(k) for k in getattr(strategy.plugin_manager.get_plugin(
                strategy.config.compression), "states", {})) if getattr(strategy, "config", None) is not None
            and strategy.config.compression else None,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "cross_node_MB": cross_node,
            "tied_elements": tied_elements,  # (through the codec: with one only)
            "stage_blocks": model._ddp_plugin_stages[0].stage_blocks if hasattr(model, "_ddp_plugin_stages") else None,
        }, os.path.join(out, f"{tag}.pt"))


def _units(strategy) -> int | None:
    """ZeRO stage 3: the units the sharder gathers and frees (the root unit stays gathered); else None."""
    manager = getattr(strategy, "plugin_manager", None)
    units = getattr(manager.get_plugin("zero_sharder") if manager is not None else None, "units", None)
    return None if units is None else sum(not unit.persistent for unit in units.units)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--devices-per-node", type=int, default=None)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--variants", default="1f1b", help="comma-separated schedule[:stage[:codec]] runs")
    parser.add_argument("--reference", action="store_true", help="Lightning ddp, the whole model on every rank")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    parser.add_argument("--flags", default="{}", help="more strategy flags, as JSON")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=0, help="save a checkpoint after this step")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--uneven", action="store_true",
                        help="2 data-parallel ranks reading 3 and 5 of each step's 8 samples")
    parser.add_argument("--nan-at", type=int, default=-1, help="a NaN gradient on global rank 2 at this step")
    parser.add_argument("--scheduler", action="store_true", help="StepLR, and a ModelCheckpoint every 10 steps")
    parser.add_argument("--prefer-codecs-on-last-stage", action="store_true",
                        help="the last pipeline stage's ranks plan a codec wherever one is measured")
    parser.add_argument("--blocks", default="list", help="'dict': the GPT's blocks in an nn.ModuleDict")
    args = parser.parse_args(argv)
    if args.prefer_codecs_on_last_stage and int(os.environ.get("LOCAL_RANK", 0)) >= args.devices - args.devices // args.pp:
        # The last stage's plan takes a codec for every stage it plans while training (as if its probe had seen a
        # slower link than the first stage's): the stages then plan a tied weight's sum apart.
        from ddp_plugin.gradients.planning import NO_CODEC, CostModel

        def prefer_a_codec(model, stage, nbytes, codecs=None):
            lossy = [c for c in (codecs or model.codecs) if c != NO_CODEC and (stage, c) in model.cross]
            return lossy[0], model.stage_seconds(stage, lossy[0], nbytes)

        CostModel.choose_codec = prefer_a_codec
    extra = {"uneven": args.uneven, "nan_at": args.nan_at, "scheduler": args.scheduler, "blocks": args.blocks}
    torch.set_num_threads(1)
    if args.reference:
        run(args.out, args.devices, None, "reference" + args.tag, None, True, args.layers, args.accumulate,
            args.save_at, args.resume, **extra)
        return
    for variant in args.variants.split(","):
        schedule, *rest = variant.split(":")
        flags = {"pipeline_parallel_size": args.pp, "tensor_parallel_size": args.tp, "pipeline_schedule": schedule,
                 **json.loads(args.flags)}
        if rest:
            flags["zero_stage"] = int(rest[0])
        if len(rest) > 1:
            flags["compression"] = rest[1]
            if rest[1] == "powersgd":  # (compressed from step 3: its default start_iter is 10, beyond STEPS)
                flags.setdefault("compression_options", {"start_iter": 2})
        run(args.out, args.devices, args.devices_per_node, variant.replace(":", "-") + args.tag, flags, False,
            args.layers, args.accumulate, args.save_at, args.resume, **extra)


if __name__ == "__main__":
    run_each(main)
