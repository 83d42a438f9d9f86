"""Worker for tests/test_memory_cap.py: a GPT whose whole fp32 weights are larger than the memory each rank
process may use, trained, checkpointed, resumed and predicted at P 2 x T 2 on 4 CPU ranks.

    python tests/workers/capped_run.py --phase fit|resume|predict --out result.json --cap-mb 1500 --name <run id>
        [--d-model 1536 --layers 16]

Each rank moves itself into a memory cgroup of its own capped at ``--cap-mb`` (``ddp_plugin.testing.cgroup``)
before it imports torch: a rank charged more is ended by the kernel, and the run fails. The model is built with
Lightning's big-model recipe (``trainer.init_module(empty_init=True)``, the meta device), and each launch runs one
phase, as a user's jobs would: ``fit`` trains 2 steps with SGD (no optimizer state: a rank holds its quarter of
the weights and of the gradients) and saves a sharded checkpoint beside ``--out``; ``resume`` trains on from it
for one more step; ``predict`` predicts from it; ``master`` trains a step with ``checkpoint="master"`` and
tries to save, which must be refused (rank 0 would gather the whole model). Rank 0 writes every rank's record (its peak charge, what it held,
the parameters' checksum where training ended or started) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--cap-mb", type=int, required=True)
parser.add_argument("--name", required=True)
parser.add_argument("--d-model", type=int, default=1536)
parser.add_argument("--layers", type=int, default=16)
parser.add_argument("--phase", choices=["fit", "resume", "predict", "master"], required=True)
args = parser.parse_args()

def load_cgroup_module():
    """``ddp_plugin.testing.cgroup`` without importing the package (whose ``__init__`` imports torch and
    Lightning: memory charged to the cgroup this process is leaving, or, for the ranks Lightning's launcher
    starts, to rank 0's)."""
    import importlib.util

    package = importlib.util.find_spec("ddp_plugin").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("_cgroup", os.path.join(package, "testing", "cgroup.py"))
    module = sys.modules["_cgroup"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cap = load_cgroup_module().MemoryCap.join(args.cap_mb << 20, f"{args.name}_{os.environ.get('LOCAL_RANK', '0')}")

import json  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from ddp_plugin import HierarchicalZeroStrategy  # noqa: E402
from ddp_plugin.hookspecs import local_tensor  # noqa: E402
from ddp_plugin.testing.gpt import GPTModule, token_dataset  # noqa: E402
from ddp_plugin.testing.processes import every_rank  # noqa: E402

SIZE = {"vocab": 32, "heads": 8, "seq": 8}


class Big(GPTModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def checksum(module) -> float:
    return float(sum(local_tensor(p).detach().double().sum() for p in module.parameters()))


class AtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.start = checksum(pl_module)


def trainer(steps: int, callbacks=()) -> L.Trainer:
    strategy = HierarchicalZeroStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, release_cpu_memory=True,
                                        checkpoint="master" if args.phase == "master" else "sharded")
    return L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks))


def build(t: L.Trainer) -> Big:
    with t.init_module(empty_init=True):
        return Big(d_model=args.d_model, layers=args.layers, **SIZE)


def main() -> None:
    torch.set_num_threads(1)
    imported = cap.current_bytes
    L.seed_everything(7, verbose=False)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    path = os.path.join(out_dir, "capped.ckpt")
    data = DataLoader(token_dataset(64, seq=8, vocab=32), batch_size=4)
    mine: dict = {"cap": cap.limit, "imported": imported}
    start = AtStart()
    t = trainer({"fit": 2, "resume": 3, "predict": -1, "master": 1}[args.phase], [start])
    model = build(t)
    mine["whole_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.phase == "fit":  # trained on meta-built weights, saved (each rank writes its part)
        t.fit(model, data)
        t.save_checkpoint(path)
        mine["saved"] = checksum(model)
    elif args.phase == "resume":  # into a model built on meta again: training starts from the saved values
        t.fit(model, data, ckpt_path=path)
        mine["start"] = start.start
    elif args.phase == "master":  # a consolidated checkpoint would gather the whole model on rank 0: refused
        t.fit(model, data)
        target = os.path.join(out_dir, "master.ckpt")
        try:
            t.save_checkpoint(target)
            mine["refused"] = None
        except MemoryError as err:
            mine["refused"] = str(err)
        mine["written"] = os.path.exists(target)
    else:
        predictions = t.predict(model, DataLoader(token_dataset(4, seq=8, vocab=32, seed=3), batch_size=4),
                                ckpt_path=path)
        mine["predicted"] = list(predictions[0].shape)
        mine["finite"] = bool(torch.isfinite(predictions[0]).all())
    mine.update(steps=t.global_step, held_bytes=sum(local_tensor(p).numel() * local_tensor(p).element_size()
                                                    for p in model.parameters()),
                peak=cap.peak_bytes, oom_kills=cap.oom_kills)
    every = every_rank(mine)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)


if __name__ == "__main__":
    main()
    sys.exit(0)
