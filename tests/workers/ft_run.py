"""Worker for the fault-tolerance tests: one replica group (one node's ranks, its own rendezvous) of a run on
torchft, training a tiny MLP on the sine task (AdamW, the learning rate decayed every step), or with tensor
parallelism or pipeline stages the tiny GPT; optionally every rank of the group kills itself (SIGKILL) at a step,
as a node lost mid-run.

    python tests/workers/ft_run.py --out DIR --group 0 --groups 3 --lighthouse http://HOST:PORT --devices 2 \\
        --steps 30 [--kill-at 10 --kill-in backward|end|sync|heal]
        [--sync-every 6 [--sync-fragments 3 --max-staleness 1]] [--tp 2 | --pp 2]
        [--compression int8]
        [--zero-stage 2] [--devices-per-node 2]
        [--step-sleep 0.05] [--dynamic-steps]
        [--hold 40:FILE[,FILE] [--mark-held FILE]] [--wait-held FILE[,FILE]] [--tag TAG] [--seed N]
        [--data-split quorum --samples 48 --shuffle]
        [--announce FILE] [--wait-start FILE] [--mark-sync FILE] [--hold-retry FILE]

Rank 0 of the group writes ``DIR/<group><tag>.pt``: the final parameters (a rank's local parts), the names of
those tensor parallelism leaves whole, and per optimizer step the time, the global step, the live replicas, the
steps lost and the heals so far, and the traffic metrics (``comm/...``), and per epoch the sampler's epoch, split
and sample indices; every
rank ``r`` its final parameters to ``DIR/<group><tag>.rank<r>.pt``, and with a sync mode its part of the global
copy and the replica's values of the fragment synced last, with that fragment's global copy, to
``DIR/<group><tag>.rank<r>.sync.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.fault_tolerance import background
from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
from ddp_plugin.hookspecs import is_tensor_parallel_shard, local_tensor
from ddp_plugin.testing.data import sine_dataset
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.processes import write_identity_file

FEATURES, HIDDEN, BATCH = 8, 16, 4


class Model(TinyModule):
    """AdamW with a learning rate that decays every step: a returning group must take its peers' schedule."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.99 ** step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def wait_until_written(*paths: str) -> None:
    """Until every file of ``paths`` exists (written by the test, or by another group)."""
    while not all(os.path.exists(p) for p in paths):
        time.sleep(0.05)


def kill_instead(replicas: ReplicaGroups, *_args) -> None:
    replicas.manager.wait_quorum()  # (in the quorum: the live groups are about to reduce with it)
    os.kill(os.getpid(), signal.SIGKILL)


class Record(L.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.kill_at, self.kill_in, self.sleep, self.gate, self.group = (
            args.kill_at, args.kill_in, args.step_sleep, args.gate, args.group)
        # (step, files): at the first step from `step` on, wait until every file exists
        self.holds = [(int(step), files.split(",")) for step, files in (h.split(":", 1) for h in args.hold)]
        self.announce = args.announce
        self.groups = args.groups
        step, _, path = (args.mark_alone or "").partition(":")
        self.alone = (int(step), path) if path else None
        self.wait_start = [args.wait_start] if args.wait_start is not None else []
        self.wait_held = args.wait_held.split(",") if args.wait_held else []
        self.mark_held = args.mark_held
        self.steps: list[dict] = []
        self.epochs: list[dict] = []
        self.sync: dict | None = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        sampler = trainer.train_dataloader.sampler
        self.epochs.append({"epoch": sampler.epoch, "num_replicas": sampler.num_replicas, "rank": sampler.rank,
                            "indices": list(sampler), "global_step": trainer.global_step})

    def on_train_start(self, trainer, pl_module) -> None:
        wait_until_written(*self.wait_held)
        if self.announce is not None:
            open(f"{self.announce}.{trainer.global_rank}", "w").close()
        wait_until_written(*self.wait_start)
        if self.gate is None:
            return
        # Every group set up before any trains (the launches of a loaded machine start far apart).
        open(f"{self.gate}.{self.group}.{trainer.global_rank}", "w").close()
        wait_until_written(self.gate)

    def on_train_end(self, trainer, pl_module) -> None:
        sync = trainer.strategy.fit.session.plugin_manager.get_plugin("outer_sync")
        if sync is None:
            return
        sync.drain()  # (a sync in flight: committed, applied at teardown)
        last = (sync.transport.replicas.manager.current_step() - 1) % sync.schedule.fragments
        self.sync = {"outer": [p.outer.detach().clone() for p in sync.pieces], "last": last,
                     "replica": [sync.access.read(p.bucket, p.lo, p.hi) for p in sync.pieces_of(last)],
                     "synced": [p.outer.detach().clone() for p in sync.pieces_of(last)]}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kill_in == "sync" and self.kill_at is not None and trainer.global_step >= self.kill_at:
            # (the next all-reduce across groups is the outer sync's; with a codec, its reduce)
            ReplicaGroups.allreduce = ReplicaGroups.reduce = kill_instead

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.kill_in == "backward" and self.kill_at is not None and trainer.global_step >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # inside the step: the live groups are about to reduce with it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        session = trainer.strategy.fit.session
        members = session.plugin_manager.get_plugin("replica_groups") if session is not None else None
        replicas = members.replicas.metrics() if members is not None else {}
        # (the step's own metrics from the session: logging a dozen through Lightning every step was two fifths of
        # this worker's sampled time)
        last = session.last_metrics if session is not None else {}
        comm = {k: float(v) for k, v in last.items() if k.startswith(("comm/", "sync/"))}
        self.steps.append({"time": time.time(), "global_step": trainer.global_step, **replicas, **comm})
        if (self.alone is not None and trainer.global_rank == 0 and trainer.global_step >= self.alone[0]
                and replicas.get("ft/replicas", self.groups) < self.groups):
            open(f"{self.alone[1]}.{self.group}", "w").close()
            self.alone = None
        if self.kill_in == "end" and self.kill_at is not None and trainer.global_step >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank of the group: the node is gone
        while self.holds and trainer.global_step >= self.holds[0][0]:
            # (so that a group started again joins while this one still trains, however slowly it starts)
            if self.mark_held is not None and trainer.global_rank == 0:
                open(f"{self.mark_held}.{self.group}", "w").close()
                self.mark_held = None
            wait_until_written(*self.holds[0][1])
            self.holds.pop(0)
        time.sleep(self.sleep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-in", choices=["end", "backward", "sync", "heal"], default="backward",
                        help="where in the step every rank of the group kills itself (sync: in the first outer sync"
                        " from --kill-at on, before its all-reduce across groups; heal: once it has received a live peer's"
                        " state, before loading it, in a quorum or in the background)")
    parser.add_argument("--sync-every", type=int, default=1, help="DiLoCo's H (1: the synchronous route)")
    parser.add_argument("--sync-fragments", type=int, default=1, help="streaming DiLoCo's fragments")
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--sync-warmup-steps", type=int, default=0)
    parser.add_argument("--compression", default=None, help="the codec of what crosses groups (`compression=`)")
    parser.add_argument("--compression-options", type=json.loads, default=None, help="`compression_options=`, JSON")
    parser.add_argument("--zero-stage", type=int, default=0, help="ZeRO inside the group (`shard_scope='node'`)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="a group of devices / this many nodes"
                        " (`devices_per_node`: the nodes simulated on loopback)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism inside the group: the tiny GPT, split")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages inside the group: the tiny GPT")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--dynamic-steps", action="store_true", help="`dynamic_steps=True`: a sync is due when the"
                        " first group asks for it")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--quorum-timeout", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="the strategy's `timeout` (torchft's collectives"
                        " and process group set-ups too)")
    parser.add_argument("--no-background-heal", action="store_true", help="`background_heal=False`: a returning"
                        " group heals inside its first quorum, the live groups waiting")
    parser.add_argument("--data-split", default="fixed", help="`fault_tolerance['data_split']`")
    parser.add_argument("--samples", type=int, default=4096, help="the dataset's size")
    parser.add_argument("--shuffle", action="store_true", help="the training dataloader shuffles")
    parser.add_argument("--seed", type=int, default=None, help="the initial parameters' seed (default: the group's"
                        " number, every group starting elsewhere)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--hold", action="append", default=[], help="STEP:FILE[,FILE]: at the first step from"
                        " STEP on, wait until every FILE exists")
    parser.add_argument("--mark-alone", default=None, help="STEP:FILE: write FILE.<group> (global rank 0) at the end"
                        " of the first step from STEP on made without every group in the quorum")
    parser.add_argument("--mark-held", default=None, help="write MARK_HELD.<group> (global rank 0) as the group"
                        " reaches its first --hold")
    parser.add_argument("--wait-held", default=None, help="FILE[,FILE]: once set up (before --announce), wait until"
                        " every FILE exists")
    parser.add_argument("--announce", default=None, help="write ANNOUNCE.<rank> once set up")
    parser.add_argument("--wait-start", default=None, help="once set up (after --announce), wait for this file"
                        " before the first step")
    parser.add_argument("--mark-sync", default=None, help="write MARK_SYNC.<step> as each outer sync is sent, before"
                        " its quorum, and MARK_SYNC.<step>.sent once its quorum is in")
    parser.add_argument("--hold-retry", default=None, help="before the quorum of the first retry of a sync that"
                        " failed, wait for this file")
    parser.add_argument("--gate", default=None, help="wait for this file before the first step (after writing"
                        " GATE.<group>.<rank>)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    write_identity_file(os.path.join(args.out, f"procs{args.group}{args.tag}"))  # (every rank: see its test's kill)

    if args.kill_in == "heal":
        # (the state received from a live peer, before it is loaded: inside the quorum, or in the background)
        ReplicaGroups._healed = kill_instead
        fetch = background.fetch

        def fetch_then_die(*args, **kwargs):
            fetch(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        background.fetch = fetch_then_die
    if args.hold_retry is not None:
        start_step, held = ReplicaGroups.start_step, []

        def hold_then_start(self, *args_, **kwargs):
            if self.uncommitted and not held and not self._started:  # (the first retry of a sync that failed)
                held.append(True)
                wait_until_written(args.hold_retry)
            start_step(self, *args_, **kwargs)

        ReplicaGroups.start_step = hold_then_start
    if args.mark_sync is not None:
        from ddp_plugin.sync import OuterSync

        send = OuterSync.send

        def mark_then_send(self, fragment):
            open(f"{args.mark_sync}.{self.step}", "w").close()
            send(self, fragment)
            open(f"{args.mark_sync}.{self.step}.sent", "w").close()  # (its quorum is in)

        OuterSync.send = mark_then_send
    # (by default different initial parameters per group: the first quorum, or with a sync mode its first sync, makes
    # them equal; seeded alike, a sync mode's first sync heals none)
    torch.manual_seed(args.group if args.seed is None else args.seed)
    if args.tp > 1 or args.pp > 1:
        model, data = GPTModule(), DataLoader(token_dataset(args.samples), batch_size=BATCH, shuffle=args.shuffle)
    else:
        model = Model(mlp(FEATURES, HIDDEN, 1, layers=1, activation=nn.Tanh))
        data = DataLoader(sine_dataset(args.samples, FEATURES, seed=3), batch_size=BATCH, shuffle=args.shuffle)
    record = Record(args)
    strategy = HierarchicalZeroStrategy(fault_tolerance={
        "replica_group": args.group, "replica_groups": args.groups, "lighthouse": args.lighthouse,
        "min_replicas": args.min_replicas, "quorum_timeout": args.quorum_timeout,
        "background_heal": not args.no_background_heal, "dynamic_steps": args.dynamic_steps,
        "data_split": args.data_split}, timeout=args.timeout,
        sync_every=args.sync_every, sync_fragments=args.sync_fragments, max_staleness=args.max_staleness,
        sync_warmup_steps=args.sync_warmup_steps, compression=args.compression, compression_options=args.compression_options, zero_stage=args.zero_stage,
        shard_scope="node", devices_per_node=args.devices_per_node, tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, num_nodes=1, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record], use_distributed_sampler=True)
    trainer.fit(model, data)
    # Every rank's parameters: the ranks of a group must hold the same replica (stage 0), or the same whole model
    # once gathered (ZeRO: gathered at the end of fit).
    torch.save({n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
               os.path.join(args.out, f"{args.group}{args.tag}.rank{trainer.global_rank}.pt"))
    if record.sync is not None:
        torch.save(record.sync, os.path.join(args.out, f"{args.group}{args.tag}.rank{trainer.global_rank}.sync.pt"))
    if trainer.global_rank == 0:
        params = {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()}
        replicated = [n for n, p in model.named_parameters() if not is_tensor_parallel_shard(p)]
        torch.save({"params": params, "steps": record.steps, "replicated": replicated, "epochs": record.epochs},
                   os.path.join(args.out, f"{args.group}{args.tag}.pt"))


if __name__ == "__main__":
    main()
