"""Worker for tests/test_meta_init.py: Lightning's big-model recipe, ``trainer.init_module(empty_init=True)``,
on every layout, one fit after the other in the same 4 processes.

    python tests/workers/meta_init_run.py --out result.jsonl [--cases dp,pp2_tp2,resume:2x2] [--steps 8]
    python tests/workers/meta_init_run.py --out result.jsonl --accelerator gpu --cases one,one_zero3,resume:one_zero3

The tiny tied GPT (``ddp_plugin.testing.gpt``, which defines ``init_weights()``) is built under the recipe; at
the start of training every rank records what it holds: where its tensors are, whether they are finite, the
LayerNorms (``reset_parameters``: weights exactly 1, biases exactly 0), the token embedding's standard deviation
(``init_weights``: 0.02), whether the tie survived, whether its data-parallel replicas hold the same bits, and
the first attention matrix's local values (tensor-parallel shards must differ), and the pipeline's split. A ``resume:<layout>`` case saves
a checkpoint from an eagerly built run and resumes it into a model built on meta (``fit(ckpt_path=...)``): training
must start from the checkpoint's values. A ``converge:<layout>`` case trains the layout longer, built eagerly and
on meta, and records both runs' losses. Rank 0 gathers every rank's record and appends one JSON line per case to
``--out``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.hookspecs import local_tensor
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.processes import every_rank, run_cases
from ddp_plugin.testing.ranks import local_parameters, replicas_identical

LAYOUTS: dict[str, dict] = {
    "dp": {},
    "2x2": {"devices_per_node": 2},
    "2x2_zero1": {"devices_per_node": 2, "zero_stage": 1},
    "2x2_zero2": {"devices_per_node": 2, "zero_stage": 2},
    "2x2_zero3": {"devices_per_node": 2, "zero_stage": 3},
    # ZeRO-3 allocates and initializes a model built on meta unit by unit: with a codec, at node scope, with a sync
    # mode, with tensor parallelism, and (tied stages: materialized whole, then sharded) with pipeline stages
    "2x2_zero3_int8": {"devices_per_node": 2, "zero_stage": 3, "compression": "int8"},
    "2x2_zero3_powersgd": {"devices_per_node": 2, "zero_stage": 3, "compression": "powersgd"},
    "2x2_zero3_fp16": {"devices_per_node": 2, "zero_stage": 3, "compression": "fp16"},
    "2x2_zero3_node_diloco": {"devices_per_node": 2, "zero_stage": 3, "shard_scope": "node", "sync_every": 2},
    "tp2_dp2_zero3": {"devices_per_node": 2, "tensor_parallel_size": 2, "zero_stage": 3},
    "pp2_dp2_zero3": {"devices_per_node": 2, "pipeline_parallel_size": 2, "zero_stage": 3},
    # a block cut between the stages (traced on meta; each stage materializes and initializes its part)
    "pp2_dp2_cut": {"devices_per_node": 2, "pipeline_parallel_size": 2,
                    "pipeline_split": [["blocks.0", "blocks.1.attn"], ["blocks.1.mlp"]]},
    "tp2_dp2": {"devices_per_node": 2, "tensor_parallel_size": 2},
    "pp2_dp2": {"devices_per_node": 2, "pipeline_parallel_size": 2},
    "pp2_tp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    # split by time: the blocks (tensor-parallel shards) timed one at a time, each materialized alone
    "pp2_tp2_time": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_split": "time"},
}

# One rank (the layouts a machine with one GPU runs over NCCL): materialized and initialized on the device.
ONE_DEVICE: dict[str, dict] = {
    "one": {},
    "one_zero3": {"zero_stage": 3},
    "one_zero3_int8": {"zero_stage": 3, "compression": "int8"},
}
DEVICES = {"cpu": "cpu", "gpu": "cuda:0"}

RESUMED = ["resume:2x2", "resume:2x2_zero3", "resume:pp2_tp2"]

CONVERGED = ["converge:pp2_tp2", "converge:2x2_zero3"]
CONVERGE_STEPS = 32


class Record(L.Callback):
    def __init__(self) -> None:
        self.start: dict = {}
        self.losses: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        strategy, gpt = trainer.strategy, pl_module.model
        tensors = [*pl_module.parameters(), *pl_module.buffers()]
        flat = self.start_flat = local_parameters(strategy, pl_module)
        with strategy.full_parameters():
            norms = [m for m in gpt.modules() if isinstance(m, torch.nn.LayerNorm)]
            # (this stage's first block that holds an attention: with a block cut between the stages, a stage may
            # hold only the part of one after its attention)
            q = next((b.attn.q.weight for b in gpt.blocks if b is not None and hasattr(b, "attn")), None)
            self.start = {
                "meta_left": any(local_tensor(t).is_meta for t in tensors),
                "devices": sorted({str(local_tensor(t).device) for t in tensors}),
                "finite": bool(torch.isfinite(flat).all()),
                "norms_reset": all(bool((local_tensor(m.weight) == 1).all() and (local_tensor(m.bias) == 0).all())
                                   for m in norms),
                "norms": len(norms),
                "tok_std": float(local_tensor(gpt.tok.weight).std()) if gpt.tok is not None else None,
                "tied": gpt.head.weight is gpt.tok.weight if gpt.head is not None and gpt.tok is not None else None,
                "replicas_identical": replicas_identical(strategy, pl_module, flat),
                "q_local": local_tensor(q).detach().flatten()[:64].tolist() if q is not None else None,
                # DTensors replicated over the tensor-parallel ranks (a row-wise layer's bias): their sums
                "replicated": {n: float(local_tensor(p).double().sum()) for n, p in pl_module.named_parameters()
                               if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)},
                "units_initialized": strategy.units_initialized,
                "tp_rank": strategy.device_mesh["tensor_parallel"].get_local_rank()
                if strategy.device_mesh is not None else 0,
                "split": [list(r) for r in pl_module._ddp_plugin_stages[0].stage_blocks]
                if hasattr(pl_module, "_ddp_plugin_stages") else None,
            }

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # whether the checkpoint file is memory-mapped while it is restored (a model no rank holds whole)
        path = os.path.realpath(trainer.ckpt_path)
        with open("/proc/self/maps") as maps:
            self.mapped = any(line.rstrip().endswith(path) for line in maps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def fit(layout: str, steps: int, meta: bool, ckpt_path: str | None = None, accelerator: str = "cpu") -> tuple:
    L.seed_everything(1234, verbose=False)
    one = layout in ONE_DEVICE
    strategy = HierarchicalZeroStrategy(**(ONE_DEVICE[layout] if one else LAYOUTS[layout]))
    record = Record()
    trainer = L.Trainer(accelerator=accelerator, devices=1 if one else 4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record])
    with trainer.init_module(empty_init=meta):
        model = GPTModule(vocab=32, d_model=32, heads=2, layers=2, seq=8, lr=3e-3)
    built_on = str(next(model.parameters()).device)
    data = DataLoader(token_dataset(8 * trainer.world_size * steps, seq=8, vocab=32), batch_size=8)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model, record, built_on


def run(case: str, steps: int, out_dir: str, accelerator: str = "cpu") -> dict:
    extra = {}
    fit_on = functools.partial(fit, accelerator=accelerator)
    if case.startswith("resume:"):
        # Saved by an eagerly built run; resumed into a model built on meta: the checkpoint's values, not the
        # initialization's, are what training starts from.
        layout = case.split(":")[1]
        trainer, model, _, _ = fit_on(layout, steps // 2, meta=False)
        path = os.path.join(out_dir, f"{layout}.ckpt")
        trainer.save_checkpoint(path)
        saved = local_parameters(trainer.strategy, model)
        trainer, model, record, built_on = fit_on(layout, steps, meta=True, ckpt_path=path)
        # (compared on the host: the fit's teardown has moved the saved run's model off a GPU)
        extra = {"resumed_equal_to_saved": bool(torch.equal(record.start_flat.cpu(), saved.cpu())),
                 "mapped": getattr(record, "mapped", None)}
    elif case.startswith("converge:"):
        # The same layout, data and seed built eagerly and on meta, trained longer: the initial values differ,
        # the losses they reach should not.
        layout = case.split(":")[1]
        _, _, eager, _ = fit_on(layout, CONVERGE_STEPS, meta=False)
        trainer, model, record, built_on = fit_on(layout, CONVERGE_STEPS, meta=True)
        extra = {"eager_losses": eager.losses}
    else:
        trainer, model, record, built_on = fit_on(case, steps, meta=True)
    mine = {**record.start, **extra, "built_on": built_on, "losses": record.losses,
            "finite_losses": all(math.isfinite(x) for x in record.losses), "steps": trainer.global_step}
    every = every_rank(mine)
    return {"case": case, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join([*LAYOUTS, *RESUMED, *CONVERGED]))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accelerator", choices=list(DEVICES), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    run_cases(args.cases.split(","), lambda case: run(case, args.steps, out_dir, args.accelerator), args.out)


if __name__ == "__main__":
    main()
