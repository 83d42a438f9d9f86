"""Worker for tests/test_transformers_pipeline.py: a Hugging Face ``LlamaForCausalLM`` (tiny, built from its
config) pipelined through its config's ``base_model_pp_plan``, its ``forward`` unchanged, in 4 processes.

    python tests/workers/transformers_run.py --weights DIR --out result.jsonl [--cases dp,pp2_dp2,...]

``dp`` fits it at D 4 (the reference), ``pp2_dp2`` the same at P 2 x D 2 and then predicts; ``meta_pp2_dp2``
builds it on meta (``trainer.init_module(empty_init=True)``) and fits; ``pretrained_meta_pp2_dp2`` builds it on
meta and predicts from the weights the test saved with ``save_pretrained`` (``DIR``). Rank 0 appends one JSON
line per case to ``--out``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import token_dataset
from ddp_plugin.testing.processes import every_rank, run_cases

VOCAB, SEQ = 64, 8
CASES = {
    "dp": ({"devices_per_node": 2}, False, "fit"),
    "pp2_dp2": ({"devices_per_node": 2, "pipeline_parallel_size": 2}, False, "fit"),
    "meta_pp2_dp2": ({"devices_per_node": 2, "pipeline_parallel_size": 2, "pipeline_microbatches": 4}, True, "fit"),
    "pretrained_meta_pp2_dp2": ({"devices_per_node": 2, "pipeline_parallel_size": 2}, True, "predict"),
    # tied embedding and head (as in Llama 3.2 1B), on the first and the last stage
    "tied_dp": ({"devices_per_node": 2}, False, "fit"),
    "tied_pp2_dp2": ({"devices_per_node": 2, "pipeline_parallel_size": 2}, False, "fit"),
    "tied_meta_pp2_dp2": ({"devices_per_node": 2, "pipeline_parallel_size": 2}, True, "fit"),
}


def config(tied: bool = False) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                       tie_word_embeddings=tied)


class Llama(L.LightningModule):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(config(tied))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.pipeline_loss(self.model(input_ids=x).logits, y)
        self.losses.append(float(loss))
        return loss

    def pipeline_loss(self, logits, y):
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"x": x, "logits": self.model(input_ids=x).logits}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run(case: str, weights: str) -> dict:
    flags, meta, mode = CASES[case]
    L.seed_everything(1234, verbose=False)
    common = {"accelerator": "cpu", "devices": 4, "logger": False, "enable_progress_bar": False,
              "enable_model_summary": False, "enable_checkpointing": False}
    if case.startswith("pretrained"):
        flags = {**flags, "pretrained": weights}
    trainer = L.Trainer(strategy=HierarchicalZeroStrategy(**flags), max_steps=6, **common)
    torch.manual_seed(7)  # (the eager model's initial values: the same in every case)
    with trainer.init_module(empty_init=meta):
        model = Llama(tied=case.startswith("tied"))
    mine: dict = {}
    data = DataLoader(token_dataset(12, seq=SEQ, vocab=VOCAB, seed=1), batch_size=4)
    if mode == "fit":
        # (16 samples a step on every layout: 4 per rank at D 4, 8 per data-parallel position at P 2 x D 2)
        batch = 16 // (4 // flags.get("pipeline_parallel_size", 1))
        trainer.fit(model, DataLoader(token_dataset(96, seq=SEQ, vocab=VOCAB), batch_size=batch))
        mine["losses"] = model.losses
        if case.startswith("tied") and case != "tied_dp":  # the stages' copies of the tied weight, after the steps
            held = dict(model.named_parameters())
            copy = held.get("model.model.embed_tokens.weight", held.get("model.lm_head.weight"))
            every = every_rank(copy.detach().clone())
            mine["tie_equal"] = all(torch.equal(every[0], c) for c in every)
            mine["tie_names"] = sorted(n for n in held if "embed" in n or "lm_head" in n)
        if case == "pp2_dp2":
            path = f"{weights}/../pp2_dp2.ckpt"
            trainer.save_checkpoint(path)
            predictions = trainer.predict(model, data)
            state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
            whole = LlamaForCausalLM(config())
            whole.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
            with torch.no_grad():
                mine["predict_error"] = max(float((p["logits"] - whole(input_ids=p["x"], use_cache=False).logits)
                                                  .abs().max()) for p in predictions)
    else:
        predictions = trainer.predict(model, data)
        whole = LlamaForCausalLM.from_pretrained(weights)
        with torch.no_grad():
            mine["predict_error"] = max(float((p["logits"] - whole(input_ids=p["x"], use_cache=False).logits)
                                              .abs().max()) for p in predictions)
    every = every_rank(mine)
    return {"case": case, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_cases(args.cases.split(","), lambda case: run(case, args.weights), args.out)


if __name__ == "__main__":
    main()
