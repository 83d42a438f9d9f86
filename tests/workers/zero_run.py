"""Worker for the ZeRO memory, optimizer-refusal and ModuleList-model tests.

    python tests/workers/zero_run.py --mode memory --out FILE.json     # 4 ranks, stages 0-3, global scope
    python tests/workers/zero_run.py --mode optimizer --optimizer lbfgs  # must fail before the first step
    python tests/workers/zero_run.py --mode optimizer --optimizer lars [--allow]  # an SGD subclass, not elementwise
    python tests/workers/zero_run.py --mode modulelist --out DIR --devices 2 --variants 1:default,3:Block
    python tests/workers/zero_run.py --mode modulelist --out DIR --devices 0  # single-process reference
    python tests/workers/zero_run.py --mode in_backward --refuse clip|manual  # optimizer_in_backward refuses it
    python tests/workers/zero_run.py --mode in_backward_resume --out DIR  # its checkpoint resumes, with or without it
    python tests/workers/zero_run.py --mode offload_resume --out DIR [--checkpoint sharded]  # the same with offload="disk"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.callbacks import ParameterHistory
from ddp_plugin.testing.data import rank_loader
from ddp_plugin.testing.models import LARS, TinyModule
from ddp_plugin.zero import allow_optimizer

WIDTH, LAYERS = 512, 4  # 4 x (512 x 512 + 512) = 1,050,624 parameters, fp32
OPTIMIZERS = {  # name -> (optimizer, its options)
    "lbfgs": (torch.optim.LBFGS, {}),
    "lars": (LARS, {"lr": 0.1}),  # an SGD subclass that is not elementwise
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
}


class MemoryAfterStep(L.Callback):
    """Right before every optimizer step but the first (parameters, gradients and state all live; stages 2-3 free
    the gradient shards once the step applied them): the strategy's ``memory_bytes()``, and at stage 3 the
    largest unit and the peak of gathered bytes."""

    def __init__(self) -> None:
        self.memory: dict[str, int] = {}
        self.largest_unit = 0
        self.peak_gathered = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            return  # (the optimizer's state is made by the first step)
        self.memory = trainer.strategy.memory_bytes()
        sharder = trainer.strategy.plugin_manager.get_plugin("zero_sharder")
        if sharder is not None and sharder.stage == 3:
            self.largest_unit = sharder.largest_unit_bytes
            self.peak_gathered = sharder.fit_peak_gathered_bytes


def fit(stage: int, optimizer: str, devices: int) -> tuple[L.Trainer, TinyModule, MemoryAfterStep]:
    L.seed_everything(0, verbose=False)
    factory, options = OPTIMIZERS[optimizer]
    # Batches of (x,): the loss is the mean square of the output.
    model = TinyModule(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]), loss="mean_square",
                       optimizer=factory, **options)
    data = TensorDataset(torch.randn(64, WIDTH))
    # One unit prefetched (FSDP's depth): tests/test_zero.py bounds the gathered bytes by it; the default depth (2)
    # is held to its budget by tests/test_memory_budget.py.
    strategy = HierarchicalZeroStrategy(zero_stage=stage, shard_scope="global", auto_wrap_policy=[nn.Linear],
                                        prefetch_units=1)
    memory = MemoryAfterStep()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                        callbacks=[memory], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return trainer, model, memory


# ---------------------------------------------------------------------------------------------- GPT-2 layout

VOCAB, SEQ, DIM, BLOCKS = 64, 8, 192, 4
# A block has 12 DIM^2 + 13 DIM = 444,864 parameters, below the default unit size (1,000,000); the four blocks
# together reach it: bottom-up grouping used to pick `transformer.h`, the ModuleList, as the unit.
GLOBAL_BATCH, STEPS = 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.c_proj(attn)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """GPT-2's layout: embeddings, the blocks in an `nn.ModuleList` (which is never called), a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.h = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT(L.LightningModule):
    """GPT-2's layout with its head tied to the token embedding: its own class, since what the test is about is
    this module tree (a ModuleList of blocks, a tied weight across units) and its token data."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = Transformer()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.lm_head(self.transformer(idx[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1),
                                           generator=torch.Generator().manual_seed(3)))
        # No shuffling: rank r's batch j together with the other ranks' is the reference's batch j.
        return rank_loader(data, GLOBAL_BATCH, self.trainer.world_size, self.trainer.global_rank)

    def configure_optimizers(self):
        # SGD: Adam's first steps are +-lr whatever a gradient's size, so gradients near rounding noise (this
        # model has many) would make the comparison with one process measure rounding instead of sharding.
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def fit_gpt(devices: int, stage: int, policy: str, out: str) -> None:
    L.seed_everything(0, verbose=False)
    model = GPT()
    if devices:
        wrap = {"default": None, "Block": [Block]}[policy]
        strategy = HierarchicalZeroStrategy(zero_stage=stage, auto_wrap_policy=wrap)
    else:
        strategy, devices = "auto", 1
    record = ParameterHistory()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        callbacks=[record], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(model)
    units = []
    if stage == 3:
        sharder = trainer.strategy.plugin_manager.get_plugin("zero_sharder")
        units = [[type(m).__name__ for m in u.modules] for u in sharder.units.units if not u.persistent]
    if trainer.is_global_zero:
        torch.save({"history": torch.stack(record.history), "max_rank_diff": record.max_rank_diff,
                    "tied": model.lm_head.weight is model.transformer.wte.weight, "units": units},
                   os.path.join(out, f"gpt-{stage}-{policy}.pt"))


class ManualStep(TinyModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = self(batch[0]).pow(2).mean()
        self.manual_backward(loss)
        self.optimizers().step()
        self.optimizers().zero_grad()


def fit_refused(what: str) -> None:
    """A fit that ``optimizer_in_backward=True`` must refuse at setup, before the first step."""
    cls = ManualStep if what == "manual" else TinyModule
    model = cls(nn.Linear(8, 8), loss="mean_square", optimizer="adamw", lr=1e-3)
    strategy = HierarchicalZeroStrategy(zero_stage=3, optimizer_in_backward=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0 if what == "clip" else None)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4))


def resume_in_backward(out: str, flags: dict | None = None) -> None:
    """Stage 3, AdamW and a scheduler, Lightning's default callbacks and logger: 6 steps without the flags; 3
    with them, a checkpoint saved by Lightning's ModelCheckpoint; resumed to 6 with them, and without them; and 3
    without them, resumed to 6 with them. ``flags``: ``optimizer_in_backward=True`` unless given."""
    digests = {}
    flags = flags or {"optimizer_in_backward": True}

    def fit(name: str, on: bool, epochs: int, ckpt_path: str | None = None) -> L.Trainer:
        L.seed_everything(0, verbose=False)
        model = TinyModule(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]), loss="mean_square",
                           optimizer="adamw", lr=1e-2, weight_decay=0.1)
        model.configure_optimizers = lambda: _with_scheduler(model)
        strategy = HierarchicalZeroStrategy(zero_stage=3, auto_wrap_policy=[nn.Linear], **(flags if on else {}))
        batches = BatchCount()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs,
                            default_root_dir=os.path.join(out, name), callbacks=[batches])
        trainer.fit(model, DataLoader(TensorDataset(torch.randn(24, 16, generator=torch.Generator().manual_seed(1))),
                                      batch_size=4), ckpt_path=ckpt_path)
        digests[name] = batches.digest
        digests[name + ":batches"] = batches.count
        return trainer

    fit("plain", False, 2)
    first = fit("first", True, 1)
    ckpt = first.checkpoint_callback.best_model_path
    fit("resumed", True, 2, ckpt)
    last = fit("resumed_plain", False, 2, ckpt)
    if "offload" in flags:  # and the other way round: saved without it, resumed with it
        plain_first = fit("plain_first", False, 1)
        last = fit("resumed_on", True, 2, plain_first.checkpoint_callback.best_model_path)
    if last.is_global_zero:
        with open(os.path.join(out, "digests.json"), "w") as f:
            json.dump(digests, f)


class BatchCount(L.Callback):
    count = 0

    def on_train_batch_end(self, *args) -> None:
        self.count += 1

    def on_train_end(self, trainer, pl_module) -> None:
        # (Inside fit: with offload_params the parameters are not gathered whole after it.)
        with trainer.strategy.full_parameters():
            self.digest = hashlib.sha256(b"".join(p.detach().clone().numpy().tobytes()
                                                  for p in pl_module.parameters())).hexdigest()


def _with_scheduler(model: TinyModule):
    optimizer = TinyModule.configure_optimizers(model)
    return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["memory", "optimizer", "modulelist", "in_backward", "in_backward_resume",
                                           "offload_resume"],
                        required=True)
    parser.add_argument("--refuse", choices=["clip", "manual"], default="clip")
    parser.add_argument("--checkpoint", choices=["master", "sharded"], default="master",
                        help="offload_resume: the checkpoint layout of the runs with offload")
    parser.add_argument("--out", default=None)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--allow", action="store_true", help="declare the optimizer elementwise (allow_optimizer)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--variants", default="0:default", help="stage:policy, comma-separated (policy: default"
                        " or Block)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "optimizer":
        if args.allow:
            allow_optimizer(LARS)
        fit(2 if args.optimizer == "lars" else 1, args.optimizer, devices=2)
        return
    if args.mode == "in_backward":
        fit_refused(args.refuse)
        return
    if args.mode == "in_backward_resume":
        resume_in_backward(args.out)
        return
    if args.mode == "offload_resume":
        resume_in_backward(args.out, {"offload": "disk", "offload_dir": os.path.join(args.out, "offload"),
                                      "offload_params": True, "checkpoint": args.checkpoint})
        return
    if args.mode == "modulelist":
        for variant in args.variants.split(","):
            stage, policy = variant.split(":")
            fit_gpt(args.devices, int(stage), policy, args.out)
        return
    rows = {}
    for stage in (0, 1, 2, 3):
        trainer, model, memory = fit(stage, "adamw", devices=4)
        rows[stage] = {**memory.memory, "largest_unit": memory.largest_unit, "peak_gathered": memory.peak_gathered,
                       "numel": sum(p.numel() for p in model.parameters())}
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
