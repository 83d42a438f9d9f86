"""Worker for tests/test_pipeline_defaults.py: pipeline stages under every Lightning default (the model summary,
the progress bar, the checkpoint callback, the logger, the sanity check), with the flags that run the user's model
at setup, one fit after the other in the same 4 processes (2 simulated nodes x 2 ranks, a stage per node).

    python tests/workers/pp_defaults_run.py --out result.jsonl --root DIR [--cases time,time-example]

The model is written as a user writes one: its ``forward`` takes a batch dict (``self.model(batch["x"])`` inside),
so ``example_input_array``, where a case sets one, is Lightning's input to ``forward`` and not the pipelined
model's. Its last two blocks compute 64 times what each of the two before it does, with the same parameters:
split by parameters the stages hold two blocks each (the heavy ones together), split by time the last is alone.
Rank 0 appends a JSON line per case: the stages' blocks, the losses, the step reached and the checkpoints written,
every rank's split and a digest of each of its parameters and of the random generators as training starts (or, for
``trainer.predict``, the predictions' shapes).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import random

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.processes import run_cases

WIDTH = 32
HEAVY = 64  # the last two blocks' passes through their layer (the others make one)
ROWS = 8  # samples per rank and step
CASES = {
    # flags, and whether the module sets `example_input_array` (the summary then runs it through the pipeline)
    "time": ({"pipeline_split": "time"}, False),
    "time-example": ({"pipeline_split": "time"}, True),
    "time-int8": ({"pipeline_split": "time", "compression": "int8", "pipeline_activations": "bf16"}, True),
    "time-checkpointing": ({"pipeline_split": "time", "activation_checkpointing_policy": ["Block"]}, True),
    "parameters-meta": ({}, True),  # built under `trainer.init_module(empty_init=True)`
    "time-meta": ({"pipeline_split": "time"}, False),  # ... and timed a block at a time
    "named-meta": ({"pipeline_split": [["inp", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "out"]]}, False),
    "time-predict": ({"pipeline_split": "time"}, False),  # `trainer.predict` on a module not split before
}


class Block(nn.Module):
    def __init__(self, passes: int) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.passes = passes

    def forward(self, h: Tensor) -> Tensor:
        for _ in range(self.passes):
            h = torch.tanh(self.lin(h))
        return h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList([Block(1), Block(1), Block(HEAVY), Block(HEAVY)])
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: Tensor) -> Tensor:  # (a child another stage holds is None)
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x) if self.out is not None else x


class Regression(L.LightningModule):
    def __init__(self, example: bool) -> None:
        super().__init__()
        self.model = Net()
        if example:  # Lightning's input to `forward`: a batch as the loader yields it (real, under init_module too)
            self.example_input_array = {"batch": {"x": torch.zeros(4, 8, device="cpu"),
                                                  "y": torch.zeros(4, 1, device="cpu")}}

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.model(batch["x"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.model(batch["x"]), batch["y"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_loss(self.model(batch["x"]), batch["y"]), prog_bar=True)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch["x"])

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Pairs(Dataset):
    """Seeded inputs and a target that depends on them, as dicts."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :1] * 0.5 - self.x[:, 1:2]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Data(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Pairs(ROWS * 2 * 3, seed=0), batch_size=ROWS, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Pairs(ROWS * 2, seed=1), batch_size=ROWS)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(Pairs(ROWS * 2, seed=2), batch_size=ROWS)


def run(case: str, root: str) -> dict:
    flags, example = CASES[case]
    L.seed_everything(7, verbose=False)
    strategy = HierarchicalZeroStrategy(devices_per_node=2, pipeline_parallel_size=2, pipeline_microbatches=4,
                                        **flags)
    # Every Lightning default on: the summary, the progress bar, the checkpoint callback, the logger.
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=6,
                        default_root_dir=os.path.join(root, case))
    with trainer.init_module(empty_init=case.endswith("-meta")):
        model = Regression(example)
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    initial: dict[str, str] = {}

    class Initial(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # (materialized and initialized by the setup)
            initial.update({name: hashlib.sha256(p.detach().cpu().numpy().tobytes()).hexdigest()
                            for name, p in pl_module.named_parameters()})
            initial["(torch's generator)"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
            initial["(Python's generator)"] = hashlib.sha256(repr(random.getstate()).encode()).hexdigest()

    trainer.callbacks += [Losses(), Initial()]
    if case.endswith("-predict"):
        predictions = trainer.predict(model, datamodule=Data())
        plan = model._ddp_plugin_stages[0]
        return {"case": case, "stage_blocks": [list(r) for r in plan.stage_blocks], "cuts": len(plan.cuts),
                "predictions": [list(p.shape) for p in predictions]}
    trainer.fit(model, datamodule=Data())
    plan = model._ddp_plugin_stages[0]
    ranks: list = [None] * dist.get_world_size()  # every rank's split, and its stage's first values
    dist.all_gather_object(ranks, ([list(r) for r in plan.stage_blocks], initial))
    return {"case": case, "stage_blocks": [list(r) for r in plan.stage_blocks], "cuts": len(plan.cuts),
            "losses": losses, "step": trainer.global_step,
            "checkpoints": sorted(os.listdir(trainer.checkpoint_callback.dirpath)),
            "splits": [split for split, _ in ranks], "initial": [values for _, values in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ddp_plugin.parallel").setLevel(logging.INFO)  # (the timing and the split chosen)
    run_cases(args.cases.split(","), lambda case: run(case, args.root), args.out)


if __name__ == "__main__":
    main()
