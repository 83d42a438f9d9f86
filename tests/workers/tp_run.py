"""Worker for the tensor-parallel tests: trains the tiny tied-embedding GPT (``ddp_plugin.testing.gpt``) and saves
the whole parameters at the end, how far the data-parallel replicas (and the copies a tensor-parallel group
shares) ever were apart, and what the run looked like.

    python tests/workers/tp_run.py --out DIR --devices 2 --reference          # Lightning ddp, 2 ranks
    python tests/workers/tp_run.py --out DIR --devices 4 --devices-per-node 2 --tp 2 --variants 0,1,2,3
    python tests/workers/tp_run.py ... --variants 0:vocab --save-at 6      # also writes DIR/0-vocab-step6.ckpt
    python tests/workers/tp_run.py ... --tp 1 --variants 0:vocab --resume CKPT --tag resumed

Every run sees the same global batch per step: data-parallel rank r of N gets samples r, r + N, ... in order
(the ranks of a tensor-parallel group read the same ones).
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from torch.utils.data import DataLoader
from torch.distributed.tensor import DTensor

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.hookspecs import local_tensor
from ddp_plugin.parallel.tensor_parallel import full_state_dict
from ddp_plugin.testing.callbacks import SaveAt
from ddp_plugin.testing.data import rank_loader
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.processes import run_each
from ddp_plugin.testing.ranks import max_group_difference

GLOBAL_BATCH = 8
STEPS = 8
EPOCH = 2  # steps per epoch: checkpoints are saved at an epoch's end (steps 4 and 6)
CLIP = 0.3  # the gradient norm stays between 0.3 and 1.3 over the steps: clipping binds on every one


class ReplicaCheck(L.Callback):
    """After every optimizer step: the largest difference of each rank's local parameters from data-parallel
    rank 0's (the replicas of a shard) and, for parameters not split by tensor parallelism, from global rank 0's
    (every rank holds them). With ``norms``, also the gradient norms before clipping at every step (the
    reference's show that clipping binds; ours that ``grad_norm()`` and ``full_gradients()`` give them)."""

    def __init__(self, norms: bool = False) -> None:
        self.norms = norms
        self.max_replica_diff = 0.0
        self.grad_norms: list[float] = []
        self.full_grad_norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.norms:
            return
        # The global gradient norm before clipping (Lightning clips after this hook): the reference's from its
        # whole gradients; ours from `strategy.grad_norm()` and from the whole gradients `full_gradients()` shows.
        strategy = trainer.strategy
        if not isinstance(strategy, HierarchicalZeroStrategy):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            return
        self.grad_norms.append(float(strategy.grad_norm(2)["grad_2.0_norm_total"]))
        with strategy.full_gradients():
            squares = sum(float((g.full_tensor() if isinstance(g, DTensor) else g).double().pow(2).sum())
                          for g in (p.grad for p in pl_module.parameters()) if g is not None)
        self.full_grad_norms.append(squares ** 0.5)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(trainer.strategy, HierarchicalZeroStrategy):
            return
        strategy = trainer.strategy
        dp_group = strategy.device_mesh.get_group("data_parallel")
        with strategy.full_parameters():
            # One all-gather per group, of every parameter it replicates: the split ones' shards over the
            # data-parallel ranks, the others over the world.
            params = list(pl_module.parameters())
            split = [local_tensor(p) for p in params if local_tensor(p) is not p]
            plain = [p for p in params if local_tensor(p) is p]
            self.max_replica_diff = max(self.max_replica_diff, max_group_difference(split, dp_group),
                                        max_group_difference(plain))


class NanAt(L.Callback):
    """At optimizer step ``step`` (0-based), global rank 1 (tensor-parallel rank 1 of data-parallel rank 0) gets a
    NaN gradient in its shard of a split weight: only one rank of the world sees it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_fit_start(self, trainer, pl_module) -> None:
        p = pl_module.model.blocks[0].attn.q.weight

        def poison(grad):
            if trainer.global_rank == 1 and trainer.global_step == self.step:
                return grad * float("nan")
            return grad

        p.register_hook(poison)


def run(out: str, devices: int, devices_per_node: int | None, tp: int, stage: int, tie: str, retie: bool,
        reference: bool, tag: str, save_at: int = 0, resume: str | None = None, flags: dict | None = None,
        uneven: bool = False, nan_at: int = -1, norms: bool = False, steps: int = STEPS, epoch: int = EPOCH) -> None:
    L.seed_everything(1234, verbose=False)
    model = GPTModule(tie=tie, retie=retie)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    if reference:
        strategy: object = "ddp"
    else:
        strategy = HierarchicalZeroStrategy(tensor_parallel_size=tp, devices_per_node=devices_per_node,
                                            zero_stage=stage, bucket_size_mb=1 / 256,
                                            auto_wrap_policy=["Block"] if stage == 3 else None,
                                            **{"hierarchical": True, **(flags or {})})
    check = ReplicaCheck(norms)
    callbacks: list[L.Callback] = [check]
    if nan_at >= 0:
        callbacks.append(NanAt(nan_at))
    if save_at:
        callbacks.append(SaveAt(save_at, os.path.join(out, f"{tag}-step{save_at}.ckpt")))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                        gradient_clip_val=CLIP, callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    data = token_dataset(GLOBAL_BATCH * epoch)

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            kwargs = trainer.strategy.distributed_sampler_kwargs
            if uneven:  # of each step's global batch, data-parallel rank 0 reads the first 3 samples, rank 1 the 5 after
                assert kwargs["num_replicas"] == 2
                lo, hi = (0, 3) if kwargs["rank"] == 0 else (3, GLOBAL_BATCH)
                steps = len(data) // GLOBAL_BATCH
                return DataLoader(data, batch_sampler=[list(range(s * GLOBAL_BATCH + lo, s * GLOBAL_BATCH + hi))
                                                       for s in range(steps)])
            return rank_loader(data, GLOBAL_BATCH, kwargs["num_replicas"], kwargs["rank"])

    trainer.fit(model, datamodule=Data(), ckpt_path=resume)
    with (trainer.strategy.full_parameters() if not reference else torch.no_grad()):
        state = full_state_dict({n: p.detach() for n, p in model.named_parameters()})
    if trainer.is_global_zero:
        torch.save({
            "params": {n: v.clone() for n, v in state.items()},
            "initial": initial,
            "max_replica_diff": check.max_replica_diff,
            "grad_norms": check.grad_norms,
            "full_grad_norms": check.full_grad_norms,
            "head_is_tok": model.model.head.weight is model.model.tok.weight,
            "types": {n: type(p).__name__ for n, p in model.named_parameters()},
            "sampler": trainer.strategy.distributed_sampler_kwargs,
            "hierarchical": getattr(trainer.strategy, "uses_hierarchical_reducer", False),
            "metrics": getattr(trainer.strategy, "metric_means", {}),
            "logged_loss": float(trainer.callback_metrics["train_loss"]),
            "skipped_steps": getattr(trainer.strategy, "skipped_steps", 0),
        }, os.path.join(out, f"{tag}.pt"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--devices-per-node", type=int, default=None)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--variants", default="0",
                        help="comma-separated stage[:tie[:noretie|CODEC]] runs (tie: replicated or vocab)")
    parser.add_argument("--reference", action="store_true", help="Lightning ddp, the whole model on every rank")
    parser.add_argument("--save-at", type=int, default=0, help="save a checkpoint after this step")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    parser.add_argument("--flags", default="{}", help="more strategy flags, as JSON")
    parser.add_argument("--nan-at", type=int, default=-1, help="a NaN gradient on global rank 1 at this step")
    parser.add_argument("--norms", action="store_true", help="record the gradient norms before clipping every step")
    parser.add_argument("--uneven", action="store_true",
                        help="2 data-parallel ranks reading 3 and 5 of each step's 8 samples")
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps")
    parser.add_argument("--epoch", type=int, default=EPOCH, help="steps per epoch (the dataset's size)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    schedule = {"steps": args.steps, "epoch": args.epoch}
    if args.reference:
        run(args.out, args.devices, None, 1, 0, "replicated", True, True, "reference", norms=args.norms, **schedule)
        return
    for variant in args.variants.split(","):
        stage, tie, *rest = variant.split(":") + ([] if ":" in variant else ["replicated"])
        flags = json.loads(args.flags)
        codecs = [word for word in rest if word != "noretie"]
        if codecs:
            flags["compression"] = codecs[0]
        run(args.out, args.devices, args.devices_per_node, args.tp, int(stage), tie, "noretie" not in rest, False,
            variant.replace(":", "-") + args.tag, args.save_at, args.resume, flags, args.uneven, args.nan_at,
            args.norms, **schedule)


if __name__ == "__main__":
    run_each(main)
