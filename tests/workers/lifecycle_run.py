"""Worker for tests/test_lightning_lifecycle.py: the strategy driven the way Lightning's own tests drive a strategy.

    python tests/workers/lifecycle_run.py --mode patched-backward --out DIR [--devices 2] [--weighting sample]
    python tests/workers/lifecycle_run.py --mode setup-without-teardown --out DIR
    python tests/workers/lifecycle_run.py --mode user-checkpoint-io --out DIR [--stage 2]

Rank 0 writes ``DIR/<mode>.json`` with what it observed.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from unittest import mock

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.data import sine_dataset
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.trees import leaves

LEARNING_RATES = {"sgd": 0.1, "adam": 1e-2}


def tiny_model(optimizer: str = "sgd") -> TinyModule:
    """8 -> 16 -> 1, tanh; SGD(lr=0.1) or Adam(lr=1e-2)."""
    return TinyModule(mlp(8, 16, 1, layers=0, activation=nn.Tanh), optimizer=optimizer, lr=LEARNING_RATES[optimizer])


def loader() -> DataLoader:
    return DataLoader(sine_dataset(64, 8, seed=0), batch_size=4)


def write(out: str, mode: str, result: dict) -> None:
    with open(os.path.join(out, f"{mode}.json"), "w") as f:
        json.dump(result, f)


def patched_backward(args: argparse.Namespace) -> None:
    """Lightning's SWA tests wrap ``Strategy.backward`` in a Mock around the strategy's own ``backward``."""
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=HierarchicalZeroStrategy(weighting=args.weighting),
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(tiny_model(), loader())
    if trainer.is_global_zero:
        write(args.out, args.mode, {"backward_calls": backward.call_count, "global_step": trainer.global_step})


def setup_without_teardown(args: argparse.Namespace) -> None:
    """Lightning's ``test_ddp_configure_ddp``: ``setup_environment`` and ``setup`` by hand, never ``teardown``;
    then the process group is destroyed, as Lightning's test fixtures do after every test."""
    collectives: list[str] = []

    def counting(name: str):
        real = getattr(dist, name)

        def call(*a, **k):
            collectives.append(f"{phase}:{name}")
            return real(*a, **k)

        return call

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HierarchicalZeroStrategy(), max_epochs=1,
                        logger=False, enable_checkpointing=False)
    model = tiny_model()
    trainer.state.fn = TrainerFn.FITTING
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    with mock.patch.object(dist, "all_gather_object", counting("all_gather_object")), \
            mock.patch.object(dist, "new_group", counting("new_group")):
        phase = "setup_environment"
        trainer.strategy.setup_environment()
        phase = "setup"
        trainer.strategy.setup(trainer)
    heartbeats = lambda: [t.name for t in threading.enumerate() if t.name == "ddp_plugin-heartbeat"]  # noqa: E731
    during = heartbeats()
    dist.destroy_process_group()
    deadline = time.monotonic() + 10
    while heartbeats() and time.monotonic() < deadline:
        time.sleep(0.05)
    write(args.out, args.mode, {"collectives": sorted(set(collectives)), "heartbeats_during": during, "heartbeats_after": heartbeats()})


class UserCheckpointIO(TorchCheckpointIO):
    """A user's own CheckpointIO (say, one that adds upload logic): records what it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.tensor_types: set[str] = set()
        self.saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saves += 1
        for _, x in leaves(checkpoint):
            if isinstance(x, torch.Tensor) or type(x).__name__.startswith("Deferred"):
                self.tensor_types.add(type(x).__name__)
        super().save_checkpoint(checkpoint, path, storage_options)


def user_checkpoint_io(args: argparse.Namespace) -> None:
    io = UserCheckpointIO()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=HierarchicalZeroStrategy(zero_stage=args.stage, checkpoint_io=io),
        max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=args.out, every_n_train_steps=2, save_top_k=-1)],
    )
    model = tiny_model("adam")
    real_save, checkpoint_saves = torch.save, []

    def save(obj, *a, **k):
        # torch.save also serializes tensors inside object collectives; count the checkpoints only.
        if isinstance(obj, dict) and "state_dict" in obj:
            checkpoint_saves.append(1)
        return real_save(obj, *a, **k)

    with mock.patch("torch.save", save):
        trainer.fit(model, loader())
    if trainer.is_global_zero:
        ckpt = torch.load(os.path.join(args.out, "epoch=0-step=4.ckpt"), weights_only=False)
        state = ckpt["optimizer_states"][0]["state"]
        write(args.out, args.mode, {
            "saves": io.saves,
            "torch_save_calls": len(checkpoint_saves),
            "tensor_types": sorted(io.tensor_types),
            "exp_avg_shapes": [list(state[i]["exp_avg"].shape) for i in sorted(state)],
            "param_shapes": [list(p.shape) for p in model.parameters()],
        })


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True, choices=["patched-backward", "setup-without-teardown", "user-checkpoint-io"])
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--weighting", default="rank")
    p.add_argument("--stage", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    {"patched-backward": patched_backward, "setup-without-teardown": setup_without_teardown,
     "user-checkpoint-io": user_checkpoint_io}[args.mode](args)


if __name__ == "__main__":
    main()
