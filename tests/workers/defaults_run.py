"""Worker for the default-paths matrix (tests/test_default_paths.py): every codec, with every other flag at its
default, on the layouts users run, a few steps each, one fit after the other in the same 4 processes.

    python tests/workers/defaults_run.py --out result.jsonl [--cases one_node/int8,2x2/powersgd] [--steps 12]

4 CPU ranks: one node of 4, 2 simulated nodes x 2 (``devices_per_node=2``; ``hierarchical`` left at ``None``, so
the link probe chooses the route), the same with ZeRO stages 1-3, and tensor or pipeline parallelism of 2 with
data parallelism of 2 across the nodes. The model is the tiny tied GPT of the tensor-parallel tests
(``ddp_plugin.testing.gpt``). 12 steps: PowerSGD's 10 uncompressed warm-up steps, then compressed ones.

Rank 0 appends one JSON line per case to ``--out`` as soon as the case is done: a case the strategy refuses at
construction (a codec a layout does not allow) records the error; a case that crashes ends the launch (Lightning's
launcher stops every rank), and the cases after it have no line. Before each case rank 0 prints its name, so the
output of a crashed launch says which case it was.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.processes import run_cases
from ddp_plugin.testing.ranks import replicas_identical

CODECS: dict[str, str | None] = {
    "none": None, "fp16": "fp16", "bf16": "bf16", "int8": "int8", "topk": "topk", "powersgd": "powersgd", "sparse": "sparse",
    "onebit": "onebit",  # the example package's codec, installed through its entry point
    "auto": "auto",
}
LAYOUTS: dict[str, dict] = {
    "one_node": {},
    "2x2": {"devices_per_node": 2},
    "2x2_zero1": {"devices_per_node": 2, "zero_stage": 1},
    "2x2_zero2": {"devices_per_node": 2, "zero_stage": 2},
    "2x2_zero3": {"devices_per_node": 2, "zero_stage": 3},
    "tp2_dp2": {"devices_per_node": 2, "tensor_parallel_size": 2},
    "pp2_dp2": {"devices_per_node": 2, "pipeline_parallel_size": 2},
    "2x2_diloco": {"devices_per_node": 2, "sync_every": 4},  # (the codec codes the pseudo-gradients)
}
CASES = [f"{layout}/{codec}" for layout in LAYOUTS for codec in CODECS]


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def run(case: str, steps: int) -> dict:
    layout, codec = case.split("/")
    flags = {**LAYOUTS[layout], "compression": CODECS[codec]}
    try:
        strategy = HierarchicalZeroStrategy(**flags)
    except ValueError as err:  # refused at construction, naming the flag: what a user would read
        return {"case": case, "refused": str(err)}
    L.seed_everything(1234, verbose=False)
    model = GPTModule(vocab=32, d_model=32, heads=2, layers=2, seq=8, lr=3e-3)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[losses])
    trainer.fit(model, DataLoader(token_dataset(8 * 4 * steps, seq=8, vocab=32), batch_size=8))
    plan = strategy.comm_plan
    return {
        "case": case,
        "steps": trainer.global_step,
        "losses": losses.losses,
        "finite": all(math.isfinite(x) for x in losses.losses),
        "replicas_identical": replicas_identical(strategy, model),
        "hierarchical": strategy.uses_hierarchical_reducer,
        "plan": None if plan is None else plan.decisions(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_cases(args.cases.split(","), lambda case: run(case, args.steps), args.out)


if __name__ == "__main__":
    main()
