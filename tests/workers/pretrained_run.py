"""Worker for tests/test_pretrained.py: ``pretrained=`` (a Hugging Face style ``safetensors`` checkpoint) read
into the tiny tied GPT on several layouts, in 4 processes.

    python tests/workers/pretrained_run.py --weights DIR --out result.jsonl [--cases pp2_tp2_meta,...]

``DIR`` holds what the test wrote: ``sharded/`` (two bf16 files, names prefixed ``transformer.``) and
``model.safetensors`` (one fp32 file, the GPT's own names, the tied head left out as Hugging Face saves it).
Predicting cases compare every prediction with the file's model run whole in this process; fitting cases compare
the first step's loss with that model's loss on the rank's batch. ``resume_*`` cases also pass ``ckpt_path``: the
checkpoint must win over the file. Rank 0 appends one JSON line per case to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os

import lightning as L
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPT, GPTModule, token_dataset
from ddp_plugin.testing.processes import every_rank, run_cases

SIZE = {"vocab": 32, "d_model": 32, "heads": 2, "layers": 4, "seq": 8}
# case: (strategy flags, which file, built on meta, "predict" or "fit")
CASES: dict[str, tuple[dict, str, bool, str]] = {
    "pp2_tp2_meta": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, "sharded", True, "predict"),
    "gpipe_p4_meta": ({"pipeline_parallel_size": 4, "pipeline_schedule": "gpipe", "pipeline_microbatches": 2},
                      "model.safetensors", True, "predict"),
    "tp2_dp2_zero3_meta": ({"tensor_parallel_size": 2, "zero_stage": 3}, "sharded", True, "fit"),
    "zero3_meta": ({"devices_per_node": 2, "zero_stage": 3}, "model.safetensors", True, "fit"),
    "dp_eager": ({"devices_per_node": 2}, "model.safetensors", False, "fit"),
    "resume_eager": ({"devices_per_node": 2}, "model.safetensors", False, "predict"),
    "resume_pp2_tp2_meta": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, "sharded", True, "predict"),
}


READ = [0]  # elements this rank read from the file (torch's reader, counted)


def _counting(read):
    def process(self, f, req, planner):
        READ[0] += math.prod(req.lengths)
        return read(self, f, req, planner)
    return process


HuggingFaceStorageReader._process_read_request = _counting(HuggingFaceStorageReader._process_read_request)


class Recording(GPTModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 0:
            self.first = (batch, float(loss))
        return loss

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"x": x, "logits": self.model(x)}


def whole_model(state: dict[str, torch.Tensor]) -> GPT:
    whole = GPT(SIZE["vocab"], SIZE["d_model"], SIZE["heads"], SIZE["layers"], SIZE["seq"])
    whole.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)  # (the tied head: the embedding)
    return whole


def file_state(weights: str, which: str) -> dict[str, torch.Tensor]:
    if which == "sharded":
        state = {}
        for name in sorted(os.listdir(os.path.join(weights, "sharded"))):
            state.update(load_file(os.path.join(weights, "sharded", name)))
        return {k.removeprefix("transformer."): v for k, v in state.items()}
    return load_file(os.path.join(weights, which))


def run(case: str, weights: str, out_dir: str) -> dict:
    flags, which, meta, mode = CASES[case]
    L.seed_everything(1234, verbose=False)
    path = os.path.join(weights, which)
    common = {"accelerator": "cpu", "devices": 4, "logger": False, "enable_progress_bar": False,
              "enable_model_summary": False, "enable_checkpointing": False}
    trainer = L.Trainer(strategy=HierarchicalZeroStrategy(pretrained=path, **flags), max_steps=2, **common)
    with trainer.init_module(empty_init=meta):
        model = Recording(**SIZE, lr=1e-3)
    checkpoint = os.path.join(out_dir, "trained.ckpt")
    expected = whole_model(file_state(weights, which))
    if mode == "fit":
        trainer.fit(model, DataLoader(token_dataset(64, seq=8, vocab=32), batch_size=4))
        (x, y), loss = model.first
        with torch.no_grad():
            error = abs(loss - float(F.cross_entropy(expected(x).reshape(-1, SIZE["vocab"]), y.reshape(-1))))
        mine = {"error": error, "loss": loss}
        if case == "dp_eager":
            trainer.save_checkpoint(checkpoint)
            # A later setup of the same module (predicting after the fit) does not read the file again.
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
            trained = whole_model({k.removeprefix("model."): v for k, v in state.items()})
            data = DataLoader(token_dataset(12, seq=8, vocab=32, seed=1), batch_size=4)
            with torch.no_grad():
                mine["after_fit"] = max(float((p["logits"] - trained(p["x"])).abs().max())
                                        for p in trainer.predict(model, data))
    else:
        data = DataLoader(token_dataset(12, seq=8, vocab=32, seed=1), batch_size=4)
        if case.startswith("resume"):
            predictions = trainer.predict(model, data, ckpt_path=checkpoint)
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
            differs = expected
            expected = whole_model({k.removeprefix("model."): v for k, v in state.items()})
        else:
            predictions = trainer.predict(model, data)
            differs = None
        with torch.no_grad():
            mine = {"error": max(float((p["logits"] - expected(p["x"])).abs().max()) for p in predictions)}
            if differs is not None:  # (the file's model predicts otherwise: the test would see it win)
                mine["file_error"] = max(float((p["logits"] - differs(p["x"])).abs().max()) for p in predictions)
    mine["read"], mine["stored"] = READ[0], sum(v.numel() for v in file_state(weights, which).values())
    READ[0] = 0
    every = every_rank(mine)
    return {"case": case, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    run_cases(args.cases.split(","), lambda case: run(case, args.weights, out_dir), args.out)


if __name__ == "__main__":
    main()
