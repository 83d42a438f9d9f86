"""One contender of ``benchmarks/cluster.py``, run by torchrun on every rank of the simulated cluster.

    torchrun ... benchmarks/cluster_worker.py --contender ours_hier --out-dir DIR --steps 8 --warmup 3

Every contender trains the same MLP on the same data from the same seed; what differs is how gradients are
synchronized. Lightning contenders run ``L.Trainer(devices=k, num_nodes=M)`` (under torchrun Lightning picks
``TorchElasticEnvironment``); FSDP2 and torch DDP + PowerSGD run a plain torch loop, because Lightning's FSDP
strategy refuses CPU and its DDP strategy ignores comm hooks on CPU.

Measured on the timed window (the steps after ``--warmup``):

- step time: rank 0's wall time per step (the whole iteration: data, forward, backward + sync, optimizer);
- cross-node bytes: the node's local rank 0 reads its veth's kernel counters right after a barrier at the start
  and at the end of the window (``/sys/class/net/$GLOO_SOCKET_IFNAME/statistics``, which inside the node's
  namespace is that namespace's view);
- for our strategy, its own accounting (``comm/cross_node_MB`` per rank) over the same window;
- loss of every step on rank 0, and peak RSS of every rank.

Each rank writes ``rank<global rank>.json`` into ``--out-dir``; the driver aggregates.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LIGHTNING_CONTENDERS = {
    # name: HierarchicalZeroStrategy kwargs, or None for Lightning's own "ddp"
    "lightning_ddp": None,
    "ours_flat": {"hierarchical": False},
    "ours_hier": {"hierarchical": True},
    "ours_hier_fp16": {"hierarchical": True, "compression": "fp16"},
    "ours_hier_int8": {"hierarchical": True, "compression": "int8"},
    # start_iter=2: the codec's default (10) would leave every step of a short run uncompressed; 2 matches the
    # smallest start_powerSGD_iter torch's hook accepts with error feedback, so both PowerSGDs compress from step 2.
    "ours_hier_powersgd": {"hierarchical": True, "compression": "powersgd",
                           "compression_options": {"rank": 4, "start_iter": 2}},
}
TORCH_CONTENDERS = ("fsdp2_hybrid", "torch_ddp_powersgd")
CONTENDERS = (*LIGHTNING_CONTENDERS, *TORCH_CONTENDERS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contender", choices=CONTENDERS, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bucket-size-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_net(args: argparse.Namespace) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(args.features, args.hidden), nn.ReLU()]
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    layers.append(nn.Linear(args.hidden, args.classes))
    return nn.Sequential(*layers)


def build_loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """This rank's share of one fixed dataset, in order. The sampler is explicit (and Lightning told not to
    replace it) so the Lightning and the plain-torch contenders see exactly the same batches."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n = (args.warmup + args.steps) * args.batch_size * world
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, args.features, generator=g)
    y = torch.randint(0, args.classes, (n,), generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


# ---------------------------------------------------------------------------------------------- measuring


def _link_counters() -> dict[str, int]:
    """This node's veth counters, as the kernel sees them in this namespace."""
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    stats = Path("/sys/class/net") / ifname / "statistics"
    if stats.is_dir():
        return {k: int((stats / f"{k}_bytes").read_text()) for k in ("tx", "rx")}
    # /sys not remounted for this namespace (not started by `ip netns exec`): ask over netlink instead.
    out = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", ifname], capture_output=True, text=True, check=True)
    s = json.loads(out.stdout)[0]["stats64"]
    return {"tx": s["tx"]["bytes"], "rx": s["rx"]["bytes"]}


class Window:
    """The timed window: per-step times on global rank 0, link counters on each node's local rank 0."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.rank = dist.get_rank()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.node = int(os.environ.get("GROUP_RANK", self.rank // int(os.environ["LOCAL_WORLD_SIZE"])))
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self.counters: dict[str, dict[str, int]] = {}
        self.window_s = 0.0
        self._t_start = 0.0
        self._last = 0.0

    def _mark(self, name: str) -> None:
        # The barrier makes every rank's traffic of the steps before it part of the window or not, on both nodes.
        dist.barrier()
        if self.local_rank == 0:
            self.counters[name] = _link_counters()
        self._last = time.perf_counter()

    def start(self) -> None:
        self._mark("start")
        self._t_start = self._last

    def step_done(self, loss: float | None = None) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self._last)
        self._last = now
        if loss is not None:
            self.losses.append(loss)

    def end(self) -> None:
        self._mark("end")
        self.window_s = self._last - self._t_start

    def result(self) -> dict[str, Any]:
        res: dict[str, Any] = {
            "rank": self.rank, "node": self.node, "local_rank": self.local_rank,
            "step_s": self.step_s, "window_s": self.window_s, "timed_steps": self.steps,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }  # fmt: skip
        if self.counters:
            res["tx_bytes"] = self.counters["end"]["tx"] - self.counters["start"]["tx"]
            res["rx_bytes"] = self.counters["end"]["rx"] - self.counters["start"]["rx"]
        return res


# ---------------------------------------------------------------------------------------------- contenders


def run_lightning(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import ddp_plugin  # noqa: F401  (registers strategy="hierarchical_zero")
    from ddp_plugin import HierarchicalZeroStrategy

    kwargs = LIGHTNING_CONTENDERS[args.contender]
    ours = kwargs is not None
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    devices = int(os.environ["LOCAL_WORLD_SIZE"])

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_net(args)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)

    class WindowCallback(L.Callback):
        """Opens the window after the warmup steps, times each following step, reads our accounting."""

        def __init__(self) -> None:
            self.window: Window | None = None
            self.ours_start: tuple[int, dict[str, float]] | None = None
            self.ours_window: dict[str, float] = {}
            self.all_losses: list[float] = []

        def _ours_snapshot(self, trainer) -> tuple[int, dict[str, float]]:
            means = getattr(trainer.strategy, "metric_means", None) or {}
            return trainer.global_step, dict(means)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            done = trainer.global_step  # optimizer steps finished, this one included
            self.all_losses.append(float(outputs["loss"]))
            if done == args.warmup:
                self.window = Window(args.steps)
                self.window.start()
                if ours:
                    self.ours_start = self._ours_snapshot(trainer)
                    self.buckets = len(trainer.strategy.engine.buckets)
            elif done > args.warmup:
                self.window.step_done(float(outputs["loss"]))
                if done == args.warmup + args.steps:
                    self.window.end()
                    if ours:
                        # metric_means are per-step means over the whole fit; turn them into sums to get the window's.
                        n1, m1 = self._ours_snapshot(trainer)
                        n0, m0 = self.ours_start
                        self.ours_window = {k: (m1[k] * n1 - m0.get(k, 0.0) * n0) / (n1 - n0) for k in m1}

    L.seed_everything(args.seed, verbose=False)
    torch.set_num_threads(1)
    model = MLP()
    if ours:
        strategy = HierarchicalZeroStrategy(bucket_size_mb=args.bucket_size_mb, **kwargs)
    else:
        strategy = DDPStrategy(bucket_cap_mb=args.bucket_size_mb)  # strategy="ddp", bucket cap spelled out
    loader = build_loader(args)
    cb = WindowCallback()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy,
        max_steps=args.warmup + args.steps, max_epochs=-1, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[cb],
    )  # fmt: skip
    trainer.fit(model, loader)
    assert trainer.world_size == nodes * devices and trainer.num_nodes == nodes, (trainer.world_size, trainer.num_nodes)
    res = cb.window.result()
    res["losses"] = cb.window.losses
    res["all_losses"] = cb.all_losses
    res["environment"] = type(trainer.strategy.cluster_environment).__name__
    if ours:
        res["ours_window"] = cb.ours_window
        res["ours_fit_means"] = trainer.strategy.metric_means
        res["hierarchical"] = trainer.strategy.uses_hierarchical_reducer
        res["buckets"] = cb.buckets
    return res


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
    """A plain training loop for the contenders Lightning cannot run on CPU."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    net = build_net(args)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

    if args.contender == "fsdp2_hybrid":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # HSDP: shard inside a node (fast), replicate across nodes: gradients are reduce-scattered inside the node,
        # then each shard is all-reduced over the nodes (S/k per rank on the slow link).
        mesh = init_device_mesh("cpu", (world // local_world, local_world), mesh_dim_names=("replicate", "shard"))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        # One bucket for the whole model: torch's PowerSGD hook waits inside future callbacks, which aborts on
        # gloo as soon as two buckets are in flight.
        cap_mb = 2 * grad_bytes / 2**20
        model = DistributedDataParallel(net, bucket_cap_mb=cap_mb)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,  # 2: the least torch allows
            use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    loader = build_loader(args)

    window: Window | None = None
    all_losses: list[float] = []
    for step, (x, y) in enumerate(loader):
        if step == args.warmup:
            window = Window(args.steps)
            window.start()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        all_losses.append(float(loss))
        if window is not None:
            window.step_done(float(loss))
        if step + 1 == args.warmup + args.steps:
            break
    window.end()
    res = window.result()
    res["losses"] = window.losses
    res["all_losses"] = all_losses
    res["environment"] = "torchrun (plain torch loop)"
    if args.contender == "torch_ddp_powersgd":
        res["buckets"] = len(model._get_ddp_logging_data().get("bucket_sizes", "").split(", ")) or None
    dist.destroy_process_group()
    return res


def main() -> None:
    args = parse_args()
    if args.contender in LIGHTNING_CONTENDERS:
        res = run_lightning(args)
    else:
        res = run_torch(args)
    res["contender"] = args.contender
    res["params"] = sum(p.numel() for p in build_net(args).parameters())
    res["grad_bytes"] = res["params"] * 4
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{res['rank']}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
