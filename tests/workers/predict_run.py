"""Worker for tests/test_pipeline_predict.py: ``trainer.predict`` with pipeline stages, in 4 processes.

    python tests/workers/predict_run.py --out result.jsonl [--cases pp2_dp2,pp2_tp2_meta,...]

``pp2_dp2`` fits the tiny tied GPT a few steps at P 2 x D 2, saves the master checkpoint and predicts with the
same Trainer; the other cases build the model on meta (``trainer.init_module(empty_init=True)``), on another
layout, and predict from that checkpoint (``trainer.predict(ckpt_path=...)``): a model no rank holds whole. The
dataset (13 samples) leaves short last batches. Every rank checks its predictions against the checkpoint's model
run whole in this process, and rank 0 appends one JSON line per case to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPT, GPTModule, token_dataset
from ddp_plugin.testing.processes import every_rank, run_cases

SIZE = {"vocab": 32, "d_model": 32, "heads": 2, "layers": 4, "seq": 8}
LAYOUTS: dict[str, dict] = {
    "pp2_dp2": {"devices_per_node": 2, "pipeline_parallel_size": 2},
    "pp2_tp2_meta": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    "interleaved_meta": {"devices_per_node": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b",
                         "pipeline_microbatches": 4},
    "gpipe_p4_meta": {"pipeline_parallel_size": 4, "pipeline_schedule": "gpipe", "pipeline_microbatches": 3},
    "dp_meta": {"devices_per_node": 2},
}


class Predicting(GPTModule):
    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"x": x, "logits": self.model(x), "batch": batch_idx}


def predict(case: str, out_dir: str) -> dict:
    L.seed_everything(1234, verbose=False)
    path = os.path.join(out_dir, "pp2_dp2.ckpt")
    common = {"accelerator": "cpu", "devices": 4, "logger": False, "enable_progress_bar": False,
              "enable_model_summary": False, "enable_checkpointing": False}
    data = DataLoader(token_dataset(13, seq=8, vocab=32, seed=1), batch_size=4)
    if case == "pp2_dp2":
        trainer = L.Trainer(strategy=HierarchicalZeroStrategy(**LAYOUTS[case]), max_steps=4, **common)
        model = Predicting(**SIZE, lr=3e-3)
        trainer.fit(model, DataLoader(token_dataset(64, seq=8, vocab=32), batch_size=8))
        trainer.save_checkpoint(path)
        predictions = trainer.predict(model, data)
    else:
        trainer = L.Trainer(strategy=HierarchicalZeroStrategy(**LAYOUTS[case]), **common)
        with trainer.init_module(empty_init=True):
            model = Predicting(**SIZE)
        predictions = trainer.predict(model, data, ckpt_path=path)
    # The checkpoint's model, whole, in this process.
    whole = GPT(SIZE["vocab"], SIZE["d_model"], SIZE["heads"], SIZE["layers"], SIZE["seq"])
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    whole.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        errors = [float((p["logits"] - whole(p["x"])).abs().max()) for p in predictions]
    mine = {"batches": [len(p["x"]) for p in predictions], "shapes": [list(p["logits"].shape) for p in predictions],
            "error": max(errors), "rows": sorted({tuple(r) for p in predictions for r in p["x"].tolist()})}
    every = every_rank(mine)
    return {"case": case, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(LAYOUTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    run_cases(args.cases.split(","), lambda case: predict(case, out_dir), args.out)


if __name__ == "__main__":
    main()
