"""One contender of ``benchmarks/cluster.py``, run by torchrun on every rank of the simulated cluster.

    torchrun ... benchmarks/cluster_worker.py --contender ours_hier --out-dir DIR --steps 8 --warmup 3

Every contender trains the same MLP on the same data from the same seed with the same optimizer (``--optimizer``);
what differs is how gradients (and, for ZeRO, optimizer state and parameters) are synchronized and sharded.
Lightning contenders run ``L.Trainer(devices=k, num_nodes=M)`` (under torchrun Lightning picks
``TorchElasticEnvironment``); FSDP2, torch DDP + PowerSGD and DeepSpeed ZeRO run a plain torch loop, because
Lightning's FSDP and DeepSpeed strategies refuse CPU and its DDP strategy ignores comm hooks on CPU.

DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) over gloo, fp32, with the same torch optimizer as
everyone else handed to ``deepspeed.initialize`` (``zero_allow_untested_optimizer``), so none of DeepSpeed's
compiled optimizers (FusedAdam, CPUAdam) is needed; see :func:`deepspeed_config`.

Measured on the timed window (the steps after ``--warmup``):

- step time: rank 0's wall time per step (the whole iteration: data, forward, backward + sync, optimizer);
- cross-node bytes: the node's local rank 0 reads its veth's kernel counters right after a barrier at the start
  and at the end of the window (``/sys/class/net/$GLOO_SOCKET_IFNAME/statistics``, which inside the node's
  namespace is that namespace's view);
- for our strategy, its own accounting (``comm/cross_node_MB`` per rank) over the same window;
- loss of every step on rank 0, and peak RSS of every rank;
- after the window (so after the last optimizer step, before any further ``zero_grad``), outside the timed steps:
  every rank's live tensor bytes, counted the same way for every contender (:func:`live_tensor_bytes`), the
  bytes of the (innermost) torch optimizer's state, and for our strategy its own ``memory_bytes()``;
- then one more, untimed "probe" step, which takes the same live-tensor count (and ``memory_bytes()``) after its
  backward and gradient synchronization, right before its optimizer step: where gradients are held, whereas after
  the step some implementations (DeepSpeed) have already released them and others (Lightning) not yet.

Each rank writes ``rank<global rank>.json`` into ``--out-dir``; the driver aggregates. A rank that fails writes
``rank<global rank>.json`` with the error (type and message) before exiting non-zero, so the driver can put the
reason in the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import harness  # (the standard library only: no ddp_plugin, whose Lightning import would weigh in peak RSS)

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
    # int8 with the default `hierarchical=None`: the link probe decides each bucket's route (flat or hierarchical).
    "ours_int8": {"compression": "int8"},
    # The link probe decides the route and codec per bucket (between no codec and int8) and the bucket size.
    "ours_auto": {"hierarchical": None, "compression": "auto", "bucket_size_mb": "auto"},
    # The same with the bucket size fixed (the run's --bucket-size-mb).
    "ours_auto_fixed_buckets": {"hierarchical": None, "compression": "auto"},
    # ZeRO stages, hierarchical reduction (the default); shard_scope "global" shards over all ranks, "node" inside a node.
    "ours_zero1": {"zero_stage": 1, "shard_scope": "global"},
    "ours_zero2": {"zero_stage": 2, "shard_scope": "global"},
    "ours_zero3": {"zero_stage": 3, "shard_scope": "global"},
    "ours_zero3_prefetch1": {"zero_stage": 3, "shard_scope": "global", "prefetch_units": 1},
    "ours_zero3_inbw": {"zero_stage": 3, "shard_scope": "global", "optimizer_in_backward": True},
    "ours_zero3_inbw_p1": {"zero_stage": 3, "shard_scope": "global", "optimizer_in_backward": True, "prefetch_units": 1},
    "ours_zero3_node": {"zero_stage": 3, "shard_scope": "node"},
    # Sync modes: nodes synchronize every 16 steps (DiLoCo: Nesterov outer step on the averaged pseudo-gradient).
    # Streaming: 16 fragments on a staggered schedule (S/16 crosses after every step), each outer all-reduce in the
    # background, applied one step late; int8 compresses the pseudo-gradients on the wire.
    "ours_diloco16": {"sync_every": 16},
    "ours_diloco16_streaming": {"sync_every": 16, "sync_fragments": 16, "max_staleness": 1},
    "ours_diloco16_streaming_int8": {"sync_every": 16, "sync_fragments": 16, "max_staleness": 1,
                                     "compression": "int8"},
    # SparseLoCo's recipe on the same schedule: 1.5 % of each chunk of 4096 in 2 bits, error feedback decayed by 0.95
    # standing in for the outer momentum (plain averaged descent).
    "ours_diloco16_streaming_sparse": {"sync_every": 16, "sync_fragments": 16, "max_staleness": 1,
                                       "compression": "sparse", "compression_options": {"decay": 0.95},
                                       "outer_optimizer": "average"},
}
# The glibc setting per path (`release_cpu_memory`): each stage-0 path with it on, ZeRO-2/3 with it off (their default
# is on), to choose the default by measurement.
LIGHTNING_CONTENDERS.update({f"{name}_release": {**kw, "release_cpu_memory": True}
                             for name, kw in list(LIGHTNING_CONTENDERS.items())
                             if name.startswith(("ours_hier", "ours_flat", "ours_diloco", "ours_int8"))})
LIGHTNING_CONTENDERS.update({f"{name}_keep_heap": {**kw, "release_cpu_memory": False}
                             for name, kw in list(LIGHTNING_CONTENDERS.items())
                             if name in ("ours_zero2", "ours_zero3", "ours_zero3_prefetch1")})
TORCH_CONTENDERS = ("fsdp2_hybrid", "fsdp2_full", "torch_ddp_powersgd")
DEEPSPEED_CONTENDERS = {"deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3}  # name -> ZeRO stage
CONTENDERS = (*LIGHTNING_CONTENDERS, *TORCH_CONTENDERS, *DEEPSPEED_CONTENDERS)
LR = {"sgd": 1e-2, "adamw": 1e-3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
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
    p.add_argument("--optimizer", choices=tuple(LR), default="sgd",
                   help="sgd: SGD(lr=0.01, momentum=0.9); adamw: AdamW(lr=1e-3), torch's other defaults")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_optimizer(args: argparse.Namespace, params) -> torch.optim.Optimizer:
    """The one optimizer every contender uses, so every contender holds the same optimizer state."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=LR["adamw"])
    return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)


def deepspeed_config(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    """fp32 ZeRO at ``stage`` with the benchmark's batch and bucket size; DeepSpeed's other settings at defaults."""
    bucket_elements = int(args.bucket_size_mb * 2**20) // 4  # fp32: our 25 MiB buckets, in elements
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket_elements, "overlap_comm": True},
        "zero_allow_untested_optimizer": True,  # a torch optimizer: no FusedAdam/CPUAdam extension to build
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_net(args: argparse.Namespace) -> nn.Sequential:
    """``ddp_plugin.testing.models.mlp(args.features, args.hidden, args.classes, layers=args.layers)``, written out:
    importing anything from ``ddp_plugin`` imports Lightning (about 125 MB more peak RSS per rank), which the
    plain-torch and DeepSpeed contenders must not pay for in the peak-RSS column. The same goes for
    :func:`_link_counters` (``ddp_plugin.testing.simcluster.link_bytes``) and ``maxrss_mb``
    (``ddp_plugin.testing.memory.peak_rss_bytes``)."""
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
    # The probe step's batches, appended: the sampler deals samples out round-robin, so every earlier batch stays
    # what it was without them.
    x = torch.cat([x, torch.randn(args.batch_size * world, args.features, generator=g)])
    y = torch.cat([y, torch.randint(0, args.classes, (args.batch_size * world,), generator=g)])
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


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


PROFILE_ENV = "DDP_BENCH_PROFILE"
"""A folder: every rank samples its own Python stacks over the timed window (``py-spy record --idle --threads
--format raw``, waits included, so a thread's samples sum to the window's wall time) into ``rank<r>.txt`` there
(``benchmarks/profile_step.py`` sets it and reads them)."""


def start_profiler() -> subprocess.Popen | None:
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        return None
    spy = Path(sys.executable).with_name("py-spy")
    out = Path(folder) / f"rank{dist.get_rank()}.txt"
    proc = subprocess.Popen([str(spy if spy.exists() else "py-spy"), "record", "--pid", str(os.getpid()), "--rate",
                             os.environ.get(f"{PROFILE_ENV}_RATE", "100"), "--idle", "--threads", "--nonblocking",
                             "--full-filenames", "--format", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # (it attaches in well under a second; the window's barrier then starts every rank together)
    return proc


def stop_profiler(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        proc.wait(timeout=60)


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
        self._profiler: subprocess.Popen | None = None

    def _mark(self, name: str) -> None:
        # The barrier makes every rank's traffic of the steps before it part of the window or not, on both nodes.
        dist.barrier()
        if self.local_rank == 0:
            self.counters[name] = _link_counters()
        self._last = time.perf_counter()

    def start(self) -> None:
        self._profiler = start_profiler()
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
        stop_profiler(self._profiler)

    def result(self) -> dict[str, Any]:
        res: dict[str, Any] = {
            "rank": self.rank, "node": self.node, "local_rank": self.local_rank,
            "step_s": self.step_s, "window_s": self.window_s, "timed_steps": self.steps,
            "maxrss_mb": _maxrss_mb(),
        }  # fmt: skip
        if self.counters:
            res["tx_bytes"] = self.counters["end"]["tx"] - self.counters["start"]["tx"]
            res["rx_bytes"] = self.counters["end"]["rx"] - self.counters["start"]["rx"]
        return res


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of ``t``'s storage (a DTensor's: its local shard's), or None where there is none to
    count: a meta tensor, an empty or invalidated storage (FSDP2 leaves some behind)."""
    try:
        t = getattr(t, "_local_tensor", t)  # DTensor (FSDP2): a wrapper without storage around the local shard
        if t.device.type == "meta":
            return None
        st = t.untyped_storage()
        nbytes = st.nbytes()
        return (st.data_ptr(), nbytes) if nbytes else None
    except Exception:  # noqa: BLE001  (wrapper subclasses and invalid storages raise various errors)
        return None


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable from Python in this process, each storage counted once.

    Walks ``gc.get_objects()`` for tensors (parameters included) and adds every parameter's ``.grad`` (a gradient
    may exist only on the C++ side until read), dedupes by ``untyped_storage().data_ptr()`` and sums
    ``untyped_storage().nbytes()``. Storages only C++ holds (DDP's reducer buckets, autograd's saved tensors,
    communication buffers) are not seen; peak RSS covers those."""
    gc.collect()
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        key = _storage_key(t)
        if key is not None:
            seen.setdefault(*key)

    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
        except Exception:  # noqa: BLE001  (objects whose __class__ lookup fails)
            continue
        add(obj)
        if isinstance(obj, nn.Parameter) and obj.grad is not None:
            add(obj.grad)
    return sum(seen.values())


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in the innermost torch optimizer's state (unwrapping DeepSpeed's ZeRO optimizer and
    Lightning's wrapper through ``.optimizer``), each storage counted once."""
    while not isinstance(optimizer, torch.optim.Optimizer) and getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    seen: dict[int, int] = {}
    for state in getattr(optimizer, "state", {}).values():
        for v in state.values():
            key = _storage_key(v) if isinstance(v, torch.Tensor) else None
            if key is not None:
                seen.setdefault(*key)
    return sum(seen.values())


def memory_result(optimizers: list[Any], strategy: Any = None) -> dict[str, Any]:
    res: dict[str, Any] = {
        "live_tensor_bytes": live_tensor_bytes(),
        "optimizer_state_bytes": sum(optimizer_state_bytes(o) for o in optimizers),
    }
    if strategy is not None and hasattr(strategy, "memory_bytes"):
        try:
            res["memory_bytes"] = {k: int(v) for k, v in strategy.memory_bytes().items()}
        except Exception as err:  # noqa: BLE001  (the method is new; a failure must not lose the run's numbers)
            res["memory_bytes_error"] = f"{type(err).__name__}: {err}"
    return res


# ---------------------------------------------------------------------------------------------- contenders


def run_lightning(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import ddp_plugin  # noqa: F401  (registers strategy="hierarchical_zero")
    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.models import TinyModule

    kwargs = LIGHTNING_CONTENDERS[args.contender]
    ours = kwargs is not None
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    devices = int(os.environ["LOCAL_WORLD_SIZE"])

    class WindowCallback(L.Callback):
        """Opens the window after the warmup steps, times each following step, reads our accounting."""

        def __init__(self) -> None:
            self.window: Window | None = None
            self.ours_start: tuple[int, dict[str, float]] | None = None
            self.ours_window: dict[str, float] = {}
            self.all_losses: list[float] = []
            self.buckets: int | None = None
            self.memory: dict[str, Any] = {}
            self.peak_rss_mb: list[float] = []

        def _ours_snapshot(self, trainer) -> tuple[int, dict[str, float]]:
            means = getattr(trainer.strategy, "metric_means", None) or {}
            return trainer.global_step, dict(means)

        def on_train_start(self, trainer, pl_module):
            self.peak_rss_mb.append(_maxrss_mb())  # (after the strategy's setup: the link probe, for ours)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            done = trainer.global_step  # optimizer steps finished, this one included
            self.all_losses.append(float(outputs["loss"]))
            self.peak_rss_mb.append(_maxrss_mb())
            if done == args.warmup:
                self.window = Window(args.steps)
                self.window.start()
                if ours:
                    self.ours_start = self._ours_snapshot(trainer)
                    engine = getattr(trainer.strategy, "engine", None)
                    self.buckets = len(engine.buckets) if engine is not None else None
            elif args.warmup < done <= args.warmup + args.steps:
                self.window.step_done(float(outputs["loss"]))
                if done == args.warmup + args.steps:
                    self.window.end()
                    if ours:
                        # metric_means are per-step means over the whole fit; turn them into sums to get the window's.
                        n1, m1 = self._ours_snapshot(trainer)
                        n0, m0 = self.ours_start
                        self.ours_window = {k: (m1[k] * n1 - m0.get(k, 0.0) * n0) / (n1 - n0) for k in m1}
                    # After the last optimizer step; Lightning zeroes gradients only before the next backward.
                    self.memory = memory_result(trainer.optimizers, trainer.strategy if ours else None)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == args.warmup + args.steps:  # the probe step, after its backward
                probe = memory_result(trainer.optimizers, trainer.strategy if ours else None)
                self.memory.update({f"{k}_backward": v for k, v in probe.items()})

    L.seed_everything(args.seed, verbose=False)
    torch.set_num_threads(1)
    model = TinyModule(build_net(args), loss="cross_entropy", optimizer=lambda params: make_optimizer(args, params))
    if ours:
        strategy = HierarchicalZeroStrategy(**{"bucket_size_mb": args.bucket_size_mb, **kwargs})
    else:
        strategy = DDPStrategy(bucket_cap_mb=args.bucket_size_mb)  # strategy="ddp", bucket cap spelled out
    loader = build_loader(args)
    cb = WindowCallback()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy,
        max_steps=args.warmup + args.steps + 1, max_epochs=-1, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[cb],
    )  # fmt: skip
    trainer.fit(model, loader)
    assert trainer.world_size == nodes * devices and trainer.num_nodes == nodes, (trainer.world_size, trainer.num_nodes)
    res = cb.window.result()
    res["losses"] = cb.window.losses
    res["all_losses"] = cb.all_losses
    res["peak_rss_mb_by_step"] = cb.peak_rss_mb  # (at the start of training, then after each step)
    res["environment"] = type(trainer.strategy.cluster_environment).__name__
    res.update(cb.memory)
    if ours:
        res["ours_window"] = cb.ours_window
        res["ours_fit_means"] = trainer.strategy.metric_means
        res["hierarchical"] = trainer.strategy.uses_hierarchical_reducer
        plan = trainer.strategy.comm_plan
        if plan is not None:
            res["comm_plan"] = {
                "version": plan.version, "probe_s": plan.probe_s, "bucket_size_mb": plan.bucket_size_mb,
                "decisions": plan.decisions(), "links": plan.model.describe(), "reasons": plan.reasons,
                "bucket_reason": plan.bucket_reason,
                "buckets": {k: {"MB": b.nbytes / 1e6, "route": b.route, "codec": b.codec,
                                "predicted_ms": b.predicted_ms, "measured_ms": b.measured_ms}
                            for k, b in plan.buckets.items()},
            }
        res["buckets"] = cb.buckets
    return res


def plain_loop(args: argparse.Namespace, step, optimizers: list[Any]) -> dict[str, Any]:
    """Warmup steps, the timed window, then the probe step. ``step(x, y, probe)`` runs one whole iteration and
    returns the loss; ``probe``, where not None, is called between backward and the optimizer step."""
    loader = build_loader(args)
    window: Window | None = None
    all_losses: list[float] = []
    probe: dict[str, Any] = {}
    res: dict[str, Any] = {}
    for i, (x, y) in enumerate(loader):
        if i == args.warmup:
            window = Window(args.steps)
            window.start()
        if i == args.warmup + args.steps:  # the probe step, untimed
            all_losses.append(float(step(x, y, lambda: probe.update(memory_result(optimizers)))))
            break
        loss = float(step(x, y, None))
        all_losses.append(loss)
        if window is not None:
            window.step_done(loss)
        if i + 1 == args.warmup + args.steps:
            window.end()
            res = window.result()
            res.update(memory_result(optimizers))  # after the last optimizer step, as for the Lightning contenders
    res["losses"] = window.losses
    res["all_losses"] = all_losses
    res.update({f"{k}_backward": v for k, v in probe.items()})
    return res


def run_deepspeed(args: argparse.Namespace) -> dict[str, Any]:
    """DeepSpeed ZeRO through ``deepspeed.initialize`` in a plain loop (Lightning's DeepSpeed strategy refuses CPU)."""
    import logging

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    net = build_net(args)
    config = deepspeed_config(args, DEEPSPEED_CONTENDERS[args.contender])
    engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=make_optimizer(args, net.parameters()),
                                                   config=config)

    def step(x: torch.Tensor, y: torch.Tensor, probe) -> torch.Tensor:
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)  # its epilogue also finishes the gradient reduction (overlap_comm included)
        if probe is not None:
            probe()
        engine.step()  # optimizer step, then DeepSpeed releases the gradients
        return loss.detach()

    res = plain_loop(args, step, [optimizer])
    res["environment"] = f"torchrun (plain torch loop), deepspeed {deepspeed.__version__}"
    res["deepspeed_optimizer"] = type(optimizer).__name__
    res["deepspeed_config"] = config
    return res


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
    """A plain training loop for the contenders Lightning cannot run on CPU."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    net = build_net(args)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

    if args.contender in ("fsdp2_hybrid", "fsdp2_full"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if args.contender == "fsdp2_hybrid":
            # HSDP: shard inside a node (fast), replicate across nodes: gradients are reduce-scattered inside the
            # node, then each shard is all-reduced over the nodes (S/k per rank on the slow link).
            mesh = init_device_mesh("cpu", (world // local_world, local_world), mesh_dim_names=("replicate", "shard"))
        else:
            # Full sharding over every rank (ZeRO-3's layout): FSDP2's default, one unit per Linear plus the root;
            # FSDP2 prefetches the next unit's all-gather (forward and backward) by default.
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
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

    optimizer = make_optimizer(args, model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor, probe) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if probe is not None:
            probe()
        optimizer.step()
        return loss.detach()

    res = plain_loop(args, step, [optimizer])
    res["environment"] = "torchrun (plain torch loop)"
    if args.contender == "torch_ddp_powersgd":
        res["buckets"] = len(model._get_ddp_logging_data().get("bucket_sizes", "").split(", ")) or None
    dist.destroy_process_group()
    return res


def main() -> None:
    args = parse_args()
    try:
        if args.contender in LIGHTNING_CONTENDERS:
            res = run_lightning(args)
        elif args.contender in DEEPSPEED_CONTENDERS:
            res = run_deepspeed(args)
        else:
            res = run_torch(args)
    except BaseException as err:
        # Leave the reason where the driver looks for results, then fail as before.
        rank = int(os.environ.get("RANK", "0"))
        harness.write_rank(args.out_dir, rank, {"rank": rank, "contender": args.contender,
                                                "error": f"{type(err).__name__}: {err}"})
        raise
    res["contender"] = args.contender
    res["params"] = sum(p.numel() for p in build_net(args).parameters())
    res["grad_bytes"] = res["params"] * 4
    res["optimizer"] = args.optimizer
    harness.write_rank(args.out_dir, res["rank"], res)


if __name__ == "__main__":
    sys.exit(main())
