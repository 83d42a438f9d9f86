"""Worker for the default-paths matrix (tests/test_default_paths.py): every codec, with every other flag at its
default, on the layouts users run, a few steps each, one fit after the other in the same 4 processes.

    python tests/workers/defaults_run.py --out result.jsonl [--cases one_node/int8,2x2/powersgd] [--steps 12]

4 CPU ranks: one node of 4, 2 simulated nodes x 2 (``devices_per_node=2``; ``hierarchical`` left at ``None``, so
the link probe chooses the route), the same with DiLoCo (``sync_every=4``), and tensor or pipeline parallelism of
2 with data parallelism of 2 across the nodes, each at ZeRO stages 0-3 (with DiLoCo the shards stay inside a node,
``shard_scope="node"``: global ones are refused with a sync mode). The model is the tiny tied GPT of the tensor-parallel tests
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
from ddp_plugin.parallel.tensor_parallel import check_flags
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.processes import run_cases
from ddp_plugin.testing.ranks import replicas_identical
from ddp_plugin.testing.pairwise import covering_pairs

CODECS: dict[str, str | None] = {
    "none": None, "fp16": "fp16", "bf16": "bf16", "int8": "int8", "topk": "topk", "powersgd": "powersgd", "sparse": "sparse",
    "onebit": "onebit",  # the example package's codec, installed through its entry point
    "auto": "auto",
}
LAYOUTS: dict[str, dict] = {
    "one_node": {},
    "2x2": {"devices_per_node": 2},
    "tp2_dp2": {"devices_per_node": 2, "tensor_parallel_size": 2},
    "pp2_dp2": {"devices_per_node": 2, "pipeline_parallel_size": 2},
    "2x2_diloco": {"devices_per_node": 2, "sync_every": 4},  # (the codec codes the pseudo-gradients)
}
STAGES = (0, 1, 2, 3)
FACTORS = {"layout": list(LAYOUTS), "stage": list(STAGES), "codec": list(CODECS)}


def case_name(layout: str, stage: int, codec: str) -> str:
    return f"{layout}{f'_zero{stage}' if stage else ''}/{codec}"


def case_flags(case: str) -> dict:
    where, codec = case.split("/")
    layout, _, stage = where.partition("_zero")
    flags = {**LAYOUTS[layout], "zero_stage": int(stage or 0), "compression": CODECS[codec]}
    if flags["zero_stage"] and flags.get("sync_every", 1) > 1:
        flags["shard_scope"] = "node"  # (a sync mode keeps a node a whole replica: global shards are refused)
    return flags




def allowed(case: dict) -> bool:
    """What the strategy accepts: the tensor-parallel flag check's own rule (a stage 3 unit takes only the codecs
    that cast each element alone); the others are refused at construction (tests/test_default_paths.py)."""
    try:
        check_flags(LAYOUTS[case["layout"]].get("tensor_parallel_size", 1), case["stage"], CODECS[case["codec"]])
    except ValueError:
        return False
    return True


ALL_CASES = [case_name(layout, stage, codec) for layout in LAYOUTS for stage in STAGES for codec in CODECS
             if allowed({"layout": layout, "stage": stage, "codec": codec})]
"""The full matrix (``pytest --full-matrix``): every codec at every ZeRO stage on every layout the strategy accepts."""
GUARDS = [("2x2", 0, "powersgd")]
"""Cases that guard a fixed bug, in the suite whatever the covering picks: PowerSGD on 2 x 2 with the default
``hierarchical`` crashed in the link probe (the probe's second bucket size met the first one's layout)."""
CASES = [case_name(*row) for row in covering_pairs(FACTORS, allowed, required=GUARDS)]
"""What the suite runs: every pair of a codec, a stage and a layout in some case (ddp_plugin.testing.pairwise)."""


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def run(case: str, steps: int) -> dict:
    flags = case_flags(case)
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
