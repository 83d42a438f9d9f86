"""Worker for the C3 tests: trains one character-level model on real text under every codec, one after the
other in the same processes, and writes what each run reached.

    python tests/workers/compression_run.py --out result.json [--configs none,fp16,...] [--steps 100]

The text is the source of the standard library's ``argparse`` module (about 100k characters; no download).
4 CPU ranks as 2 simulated nodes x 2 (``devices_per_node=2``), so the hierarchical reducer runs and each codec
compresses the cross-node shard, over several buckets (a 0.1 MB bucket cap). Every configuration sees the same
initial parameters and the same batches; the result for each is the loss on held-out text (the last 10% of the
file) after the same number of steps, plus the mean training loss of the last 20 steps and the cross-node
traffic per step as the strategy's accounting measured it. The model, the text and the data are
:mod:`ddp_plugin.testing.text`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
import torch.distributed as dist

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.ranks import identical_on_all_ranks
from ddp_plugin.testing.text import CharModel, corpus, text_data

CONFIGS: dict[str, tuple[str | None, dict]] = {
    "none": (None, {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "int8": ("int8", {}),
    "topk": ("topk", {}),
    "powersgd": ("powersgd", {}),
    "sparse": ("sparse", {}),  # (1.5 % of each chunk of 4096, 2 bits)
    "onebit": ("onebit", {}),  # the example package's codec, installed through its entry point
    # The link probe chooses the route and, between no codec and int8, the codec per bucket (docs/adaptive.md).
    "auto": ("auto", {}),
    # ... with the installed example codec as a candidate, timed by the probe through its entry point.
    "auto_onebit": ("auto", {"candidates": [None, "onebit"]}),
}


def run(name: str, steps: int, ids: torch.Tensor, vocab: int, out_dir: str) -> dict:
    compression, options = CONFIGS[name]
    train, held_x, held_y = text_data(ids, steps)

    L.seed_everything(1234, verbose=False)
    model = CharModel(vocab, train)
    strategy = HierarchicalZeroStrategy(
        devices_per_node=2, compression=compression, compression_options=options, bucket_size_mb=0.1,
        hierarchical=None if compression == "auto" else True,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    start = time.perf_counter()
    trainer.fit(model)
    seconds = time.perf_counter() - start

    # Codec state through a real checkpoint: every rank takes part in saving, rank 0 writes everyone's state.
    path = os.path.join(out_dir, f"{name}.ckpt")
    trainer.save_checkpoint(path)
    saved = None
    if trainer.is_global_zero:
        saved = codec_state_by_rank(torch.load(path, weights_only=False), f"codec/{compression}")

    identical = identical_on_all_ranks(trainer.strategy, model)
    held_out = model.loss(held_x, held_y)
    return {
        "codec": compression,
        "options": options,
        "held_out_loss": held_out,
        "train_loss_last20": sum(model.losses[-20:]) / len(model.losses[-20:]),
        "first_loss": model.losses[0],
        "steps": trainer.global_step,
        "cross_node_MB_per_step": strategy.metric_means.get("comm/cross_node_MB"),
        "buckets": model.num_buckets,
        "identical_on_all_ranks": identical,
        "seconds": seconds,
        "hierarchical": strategy.uses_hierarchical_reducer,
        "plan": None if strategy.comm_plan is None else strategy.comm_plan.decisions(),
        "plan_codecs": None if strategy.comm_plan is None else list(strategy.comm_plan.codecs),
        "saved_state": None if saved is None else {
            "world_size": saved["world_size"],
            "buckets_per_rank": [len(rank_state) for rank_state in saved["ranks"]],  # per-bucket entries
            "keys": sorted({k for rank_state in saved["ranks"] for s in rank_state.values() if isinstance(s, dict)
                            for k in s}),
        },
    }


def codec_state_by_rank(checkpoint: dict, key: str) -> dict | None:
    """The codec's state as every rank saw it, per bucket: the shared part (``checkpoint["ddp_plugin"]``) with each
    rank's own (``checkpoint["ddp_plugin_ranks"]``); ``None`` when the checkpoint holds none."""
    shared = checkpoint.get("ddp_plugin", {}).get(key)
    ranks = checkpoint.get("ddp_plugin_ranks")
    own = [r.get(key) for r in ranks["ranks"]] if ranks is not None else []
    if shared is None and not any(o is not None for o in own):
        return None
    world = ranks["world_size"] if ranks is not None else 1
    merged = []
    for r in range(world):
        mine = own[r] if r < len(own) and own[r] is not None else {}
        buckets = {}
        for index in {*(shared or {}), *mine}:
            a, b = (shared or {}).get(index), mine.get(index)
            buckets[index] = {**a, **b} if isinstance(a, dict) and isinstance(b, dict) else (b if b is not None else a)
        merged.append(buckets)
    return {"world_size": world, "ranks": merged}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids, vocab = corpus()
    results = {}
    for name in args.configs.split(","):
        results[name] = run(name, args.steps, ids, vocab, os.path.dirname(os.path.abspath(args.out)))
        if name == "onebit":
            import onebit_codec

            results[name]["module"] = onebit_codec.__file__
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
