"""Worker for tests/test_gpu_ready.py: what one GPU can show of the CUDA path (one NCCL rank; NCCL refuses two
ranks on one GPU). Runs on CPU too (``--device cpu``, gloo), where the stream checks have nothing to look at.

    python tests/workers/gpu_ready.py --out result.json [--device cuda]

- ``streams``: a model of 8 buckets under a plugin (``SlowLink``) that reduces every bucket over NCCL after a
  20 ms GPU spin on the stream it is called on. The backward's stream must not wait for it: the time from the
  first gradient to the last, between events of the backward's stream, stays far below one spin. The plugin
  records which stream it ran on (not the default stream).
- ``timings``: the same run's ``comm/time_ms`` must count the spins (8 x 20 ms a step): a clock read when the
  collective was queued (or its future completed, which on NCCL is at enqueue) would say ~0.
- ``syncs``: host synchronizations per training step, counted by torch's sync debug mode, with 8 buckets and
  with 2 under ``skip_nonfinite`` (the finite check of every bucket): the same count, none per bucket.
- ``fp16``: ``16-mixed`` (CUDA's GradScaler) with ``gradient_clip_norm=0.05`` equals Lightning's single-device
  training with ``gradient_clip_val=0.05``.
"""

from __future__ import annotations

import argparse
import json
import warnings

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy, hookimpl

SPIN_S = 0.02
WIDTH, LAYERS = 512, 8  # 1 MiB of float32 gradients per layer: one bucket each at bucket_size_mb=1


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._first: torch.cuda.Event | None = None
        if torch.cuda.is_available():
            # The last layer's gradient comes first in backward, the first layer's last.
            self.layers[-1].weight.register_post_accumulate_grad_hook(self._mark_first)
            self.layers[0].weight.register_post_accumulate_grad_hook(self._mark_last)

    def _mark_first(self, p: nn.Parameter) -> None:
        if p.is_cuda:
            self._first = torch.cuda.Event(enable_timing=True)
            self._first.record()

    def _mark_last(self, p: nn.Parameter) -> None:
        if p.is_cuda and self._first is not None:
            last = torch.cuda.Event(enable_timing=True)
            last.record()
            self.marks.append((self._first, last))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layers(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SlowLink:
    """Reduces each bucket over the default group after a GPU spin of SPIN_S on the stream it is called on."""

    def __init__(self) -> None:
        self.streams: set[int] = set()
        self.default_stream = torch.cuda.default_stream().stream_id if torch.cuda.is_available() else None
        self.cycles = int(SPIN_S * torch.cuda.clock_rate() * 1e6) if torch.cuda.is_available() else 0

    @hookimpl
    def on_bucket_ready(self, bucket):
        if bucket.buffer.is_cuda:
            self.streams.add(torch.cuda.current_stream().stream_id)
            torch.cuda._sleep(self.cycles)
        return dist.all_reduce(bucket.buffer, async_op=True).get_future()


def loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)),
                      batch_size=8)


def trainer(strategy, device: str, steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=strategy,
                     max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kwargs)


def streams_and_timings(device: str) -> dict:
    L.seed_everything(0, verbose=False)
    link = SlowLink()
    strategy = HierarchicalZeroStrategy(plugins=[link], bucket_size_mb=1)
    model = Net()
    t = trainer(strategy, device, 6)
    t.fit(model, loader())
    if device == "cuda":
        torch.cuda.synchronize()
    backward_ms = [a.elapsed_time(b) for a, b in model.marks[1:]]  # (the first step warms up)
    return {"backend": dist.get_backend() if dist.is_initialized() else None,
            "buckets": len(strategy.fit.session.engine.buckets),
            "link_streams": sorted(link.streams), "default_stream": link.default_stream,
            "backward_ms": backward_ms, "metric_means": strategy.metric_means}


def syncs_per_step(device: str, bucket_size_mb: float, steps: int = 6) -> float:
    L.seed_everything(0, verbose=False)
    strategy = HierarchicalZeroStrategy(bucket_size_mb=bucket_size_mb, skip_nonfinite=True)
    t = trainer(strategy, device, 2)
    model = Net()
    t.fit(model, loader())  # (warm-up: allocations, first-step paths)
    counted = trainer(HierarchicalZeroStrategy(bucket_size_mb=bucket_size_mb, skip_nonfinite=True), device, steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            counted.fit(model, loader())
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return len(syncs) / steps


def fp16(device: str) -> dict:
    if device != "cuda":
        return {}
    out = {}
    for name, strategy, clip in [("lightning", "auto", {"gradient_clip_val": 0.05}),
                                 ("ours", HierarchicalZeroStrategy(gradient_clip_norm=0.05), {})]:
        L.seed_everything(0, verbose=False)
        model = Net()
        t = trainer(strategy, device, 8, precision="16-mixed", **clip)
        t.fit(model, loader())
        out[name] = torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()]).tolist()
        out[name + "_scale"] = float(t.precision_plugin.scaler.get_scale())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    result = {"streams": streams_and_timings(args.device),
              "syncs": {"8": syncs_per_step(args.device, 1), "2": syncs_per_step(args.device, 4)},
              "fp16": fp16(args.device)}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
