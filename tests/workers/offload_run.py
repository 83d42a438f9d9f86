"""Worker for tests/test_offload.py and benchmarks/offload.py: a GPT built on meta, trained with ZeRO-3 on 4 CPU ranks,
with ``offload="disk"`` (optimizer state and parameter shards in files) or without offload, each rank in a memory
cgroup of its own.

    python tests/workers/offload_run.py --out result.json --name <run id> [--offload disk|none]
        [--cap-mb N | --budget-mb N] [--d-model 1280 --layers 12 --steps 3] [--dir DIR]

``--cap-mb N``: the rank's cgroup is capped at N MiB from its start (imports included). ``--budget-mb N``: capped at
what the rank holds after its imports plus N MiB (the scaled-down form for small models, whose imports would
dwarf them). Neither: the cgroup only measures. Rank 0 writes every rank's record (cap, what it held after imports,
peak charge, OOM kills, the training state's bytes, the rank's share of them) and the loss of every step.
"""

from __future__ import annotations

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--name", required=True)
parser.add_argument("--offload", choices=["disk", "none"], default="disk")
parser.add_argument("--cap-mb", type=int, default=0)
parser.add_argument("--budget-mb", type=int, default=0)
parser.add_argument("--d-model", type=int, default=1280)
parser.add_argument("--layers", type=int, default=12)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--in-backward", action="store_true", help="optimizer_in_backward=True")
parser.add_argument("--dir", default=None, help="offload_dir (default: beside --out)")
args = parser.parse_args()


def load_cgroup_module():
    """``ddp_plugin.testing.cgroup`` without importing the package (whose ``__init__`` imports torch)."""
    import importlib.util

    package = importlib.util.find_spec("ddp_plugin").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("_cgroup", os.path.join(package, "testing", "cgroup.py"))
    module = sys.modules["_cgroup"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UNCAPPED = 64 << 30
cap = load_cgroup_module().MemoryCap.join((args.cap_mb << 20) or UNCAPPED,
                                          f"{args.name}_{os.environ.get('LOCAL_RANK', '0')}")

import json  # noqa: E402
import time  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from ddp_plugin import HierarchicalZeroStrategy  # noqa: E402
from ddp_plugin.testing.gpt import GPTModule, token_dataset  # noqa: E402
from ddp_plugin.testing.processes import every_rank  # noqa: E402

SIZE = {"vocab": 32, "heads": 8, "seq": 8}


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.step_peaks: list[int] = []
        self.setup_peak = 0
        self._t = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.setup_peak = cap.peak_bytes  # (the model built, materialized and sharded)
        cap.reset_peak()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_s.append(time.perf_counter() - self._t)
        self.losses.append(float(outputs["loss"]))
        self.step_peaks.append(cap.peak_bytes)
        cap.reset_peak()


class Sampler:
    """The cgroup's charge broken down (``memory.stat``: rss, cache, mapped_file, dirty) at its highest charge
    seen, sampled every 20 ms on a thread (cgroup v1; v2: anon, file, file_mapped, file_dirty)."""

    def __init__(self) -> None:
        import threading

        self.at_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        best = -1
        while not self._stop.wait(0.02):
            try:
                stat = dict(line.split() for line in (cap.path / "memory.stat").read_text().splitlines())
                usage = cap.current_bytes
            except OSError:
                continue
            if usage > best:
                best = usage
                self.at_peak = {"usage": usage, **{k: int(v) for k, v in stat.items() if k in (
                    "rss", "cache", "mapped_file", "dirty", "writeback", "anon", "file", "file_mapped", "file_dirty")}}

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.at_peak


def main() -> None:
    torch.set_num_threads(1)
    sampler = Sampler()
    imported = cap.current_bytes
    if args.budget_mb:
        cap.set_limit(imported + (args.budget_mb << 20))
    cap.reset_peak()
    L.seed_everything(7, verbose=False)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    offload = {} if args.offload == "none" else dict(
        offload="disk", offload_dir=args.dir or os.path.join(out_dir, "offload"), offload_params=True)
    strategy = HierarchicalZeroStrategy(zero_stage=3, auto_wrap_policy=["Block"], prefetch_units=1,
                                        release_cpu_memory=True, optimizer_in_backward=args.in_backward, **offload)
    losses = Losses()
    t = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[losses])
    with t.init_module(empty_init=True):
        model = GPTModule(d_model=args.d_model, layers=args.layers, lr=1e-4, **SIZE)
    numel = sum(p.numel() for p in model.parameters())
    data = DataLoader(token_dataset(4 * 4 * args.steps, seq=8, vocab=32), batch_size=4)
    t.fit(model, data)
    dist.barrier()  # (every rank past its teardown before any lists the offload directory)
    # After fit the module is whole (with offload_params: in mapped files): its checksum, read from there.
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    # Weights, gradients and AdamW's two moments, fp32: 16 bytes a parameter; a rank's share is a quarter.
    mine = {"cap": cap.limit, "imported": imported, "peak": cap.peak_bytes, "oom_kills": cap.oom_kills,
            "state_bytes": 16 * numel, "share_bytes": 16 * numel // 4, "params": numel, "steps": t.global_step,
            "checksum": checksum,
            "losses": losses.losses, "at_peak": sampler.stop(), "step_s": losses.step_s,
            "setup_peak": losses.setup_peak, "step_peaks": losses.step_peaks,
            "offload_dir_entries": sorted(os.listdir(offload["offload_dir"])) if offload else None}
    every = every_rank(mine)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)


if __name__ == "__main__":
    main()
    sys.exit(0)
