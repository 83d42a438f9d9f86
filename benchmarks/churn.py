"""Many replica groups that come and go, on mixed links, with the lighthouse killed and started again: goodput against
the same cluster without churn, how long any rank was blocked, whether the groups end equal bit for bit.

    sudo python benchmarks/churn.py                        # 16 groups, 10 minutes; writes benchmarks/results/churn.md
    sudo python benchmarks/churn.py --groups 6 --minutes 2.5 --rates 2x1gbit,3x100mbit,1x20mbit --repeats 1

The simulated cluster has a node per group (a rank each), a node for each group joining with a new id, and one for
the lighthouse. Each node has its own link rate (``--rates``, in group order; the joiners and the lighthouse at the
first rate) and a CPU quota (``--cpu`` cores, default the machine's cores over the groups' nodes: a restarting group's imports do not slow the
others, as they would not on separate machines; the lighthouse's node has none). One-way delays need netem, which not every kernel has
(``SimulatedCluster(delay=...)``); this script uses none unless ``--delays`` gives them. Every group is started as a
user starts one: ``ddp-plugin-group`` (``python -m ddp_plugin.fault_tolerance.launch``) around
``benchmarks/ft_worker.py`` (an MLP of ``--width``, AdamW, ``data_split="quorum"``, the lighthouse's
``min_replicas`` a majority of the groups, so that a lighthouse started again cannot split them).

Runs (``--runs``), each ``--minutes`` long, then every live group stops at a common step a sync or two ahead:

- **no churn** (``--repeats`` seeds): every group from start to end; the mean goodput is what the churn run is compared
  to, the final losses give the spread;
- **churn**: every ``--period`` s (uniform in [0.67, 1.33] x) a random group is killed (SIGKILL, every process of
  its node) and started again ``--down`` s later (uniform in [0.25, 1] x); ``--joins`` groups with new ids join and
  ``--retire`` groups leave for good, spread over the run; the lighthouse is killed and started again
  ``--lighthouse-restarts`` times (down 3 s); with ``--standby`` a second lighthouse runs beside it (every group
  given both, ``ddp-plugin-group --lighthouse A,B``), and each of those times the one in use is killed, the groups
  go on with the other, and the killed one is started again 3 s later as their standby;
- **fast links**: every link at the first rate, no churn: what the slow links cost the others.

Goodput: useful samples a second of the live groups over the run (the first step to the common last one): every
group's optimizer steps times the batch, less the steps its syncs lost (``ft/steps_lost``) and, for a killed
group, the steps after its last committed sync. A running group's goodput: the same useful samples over the
group-seconds between each launch's first step and its last (what churn costs the groups while they run: the
lighthouse's restarts, quorums that change, heals, lost steps; not a killed group's time down and starting).
Blocked: the longest time between two steps of one process (the first step after a start or a heal excluded),
against ``quorum_timeout`` plus a step. Needs root (network
namespaces, cgroups); a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path

import harness
from harness import kill_node, records, start_group

import torch

LIGHTHOUSE_PORT = 29510


def held_out_loss(params: dict, width: int) -> float:
    """The mean squared error of a group's final parameters (``ft_worker``'s MLP) on 8192 samples it never trained
    on (its data is ``sine_dataset(..., seed=3)``): the runs' final loss, free of the last batches' noise (the
    training loss of one step varies 3x between steps at its end)."""
    from torch import nn

    from ddp_plugin.testing.data import sine_dataset

    net = harness.ft_net(width)
    net.load_state_dict({k[len("net."):]: v for k, v in params.items() if k.startswith("net.")})
    x, y = sine_dataset(8192, 8, seed=99).tensors
    with torch.no_grad():
        return nn.functional.mse_loss(net(x), y).item()


def route(args: argparse.Namespace) -> str:
    """The groups' route, as the results' header names it."""
    codec = f"compression {args.compression}" + (f" {json.dumps(args.compression_options)}"
                                                if args.compression_options else "")
    if args.sync_every == 1:
        return f"synchronous (a quorum and an all-reduce across groups every step; {codec})"
    outer = f"outer_optimizer {args.outer_optimizer}, " if args.outer_optimizer else ""
    return (f"DiLoCo H={args.sync_every} ({outer}{codec}, max_staleness {args.max_staleness},"
            f" sync_fragments {args.sync_fragments}, dynamic_steps {args.dynamic_steps})")


def rates_of(text: str) -> list[str]:
    """``"4x1gbit,8x100mbit"`` -> the rates in order."""
    import re

    out = []
    for part in harness.split(text):
        found = re.fullmatch(r"(?:(\d+)x)?(\S+)", part)
        out += [found.group(2)] * int(found.group(1) or 1)
    return out


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Run:
    """One run: the lighthouse, the groups, the events, on ``cluster``; results read from the groups' records."""

    def __init__(self, cluster, args: argparse.Namespace, out: Path, name: str, seed: int) -> None:
        self.cluster, self.args, self.out, self.name, self.seed = cluster, args, out, name, seed
        self.lh_node = cluster.nodes - 1
        self.address = f"http://{cluster.addresses[self.lh_node]}:{LIGHTHOUSE_PORT}"
        self.addresses = [self.address, *([f"http://{cluster.addresses[self.lh_node]}:{LIGHTHOUSE_PORT + 1}"]
                                          if args.standby else [])]
        """What every group is given (a standby second: on the same node, at another port)."""
        self.lighthouses: list[subprocess.Popen | None] = [None] * len(self.addresses)
        self.in_use = 0
        self.procs: dict[int, subprocess.Popen] = {}
        self.launches: dict[int, int] = {}  # group -> launches so far
        self.events: list[tuple[float, str, int]] = []
        self.samples: list[dict] = []  # memory over time
        self.rng = random.Random(seed)

    # -- processes

    @property
    def lighthouse(self) -> subprocess.Popen | None:
        return self.lighthouses[self.in_use]

    def start_lighthouse(self, i: int = 0) -> None:
        from ddp_plugin.fault_tolerance.launch import lighthouse_command

        self.lighthouses[i] = self.cluster.popen(
            self.lh_node, [*lighthouse_command(), "--min_replicas", str(self.args.groups // 2 + 1), "--join_timeout_ms",
                           "5000", "--heartbeat_timeout_ms", "1000", "--bind", f"[::]:{LIGHTHOUSE_PORT + i}"],
            stdout=open(self.out / f"lighthouse{i or ''}.txt", "a"), stderr=subprocess.STDOUT)

    def stop_lighthouses(self) -> None:
        for proc in self.lighthouses:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def launch(self, group: int, gate: bool = False) -> None:
        k = self.launches.get(group, 0)
        self.launches[group] = k + 1
        tag = f"-l{k}"
        port = 29600 + group
        spec = {"out": str(self.out), "node": group, "tag": tag, "group": group, "groups": self.args.groups,
                "nodes": self.args.groups, "steps": 10**6, "lighthouse": self.address, "sleep": self.args.step_sleep,
                "sync_every": self.args.sync_every, "compression": self.args.compression, "batch": self.args.batch,
                "outer_optimizer": self.args.outer_optimizer, "compression_options": self.args.compression_options,
                "data_split": "quorum", "seed": self.seed, "width": self.args.width,
                "quorum_timeout": self.args.quorum_timeout, "timeout": self.args.timeout, "min_replicas": self.args.groups // 2 + 1,
                "stop_file": str(self.out / "stop"), "save_params": True, "max_staleness": self.args.max_staleness,
                "sync_fragments": self.args.sync_fragments, "dynamic_steps": self.args.dynamic_steps,
                **({"gate": str(self.out / "gate")} if gate else {})}
        prefix = ["-m", "ddp_plugin.fault_tolerance.launch", "--group", str(group), "--groups", str(self.args.groups),
                  "--lighthouse", ",".join(self.addresses), "--master-addr", self.cluster.addresses[group], "--master-port",
                  str(port)]
        self.procs[group] = start_group(self.cluster, group, spec, self.out, port, tag, prefix)
        self.events.append((time.time(), "start", group))

    def kill(self, group: int) -> None:
        kill_node(self.cluster, group, self.procs.pop(group))
        self.events.append((time.time(), "kill", group))

    def restart_lighthouse(self) -> None:
        """The lighthouse in use killed, and started again 3 s later (with a standby: the groups go on with the
        standby meanwhile, and the one killed is theirs from then on)."""
        down = self.in_use
        os.killpg(self.lighthouse.pid, signal.SIGKILL)
        self.lighthouse.wait()
        self.events.append((time.time(), "lighthouse down", -1))
        self.in_use = (down + 1) % len(self.lighthouses)
        time.sleep(3.0)
        self.start_lighthouse(down)
        self.events.append((time.time(), "lighthouse up" if self.in_use == down else "standby up", -1))

    def sample(self) -> None:
        row = {"time": time.time(), "lighthouse_mb": rss_mb(self.lighthouse.pid) if self.lighthouse else 0.0}
        ranks = []
        for group in list(self.procs):
            pids = subprocess.run(["ip", "netns", "pids", self.cluster.node_namespace(group)], capture_output=True,
                                  text=True).stdout.split()
            ranks.append(max((rss_mb(int(p)) for p in pids), default=0.0))
        row["rank_mb"] = max(ranks, default=0.0)
        self.samples.append(row)

    # -- the run

    def go(self, churn: bool) -> dict:
        a = self.args
        for i in range(len(self.lighthouses)):
            self.start_lighthouse(i)
        time.sleep(1.0)
        for g in range(a.groups):
            self.launch(g, gate=True)
        harness.open_gate(self.out, [self.out / f"gate.{g}.0" for g in range(a.groups)], list(self.procs.values()),
                          timeout=900)
        t0 = time.time()
        end = t0 + a.minutes * 60
        plan: list[tuple[float, str, int]] = []  # (time, what, group)
        if churn:
            at = t0 + a.period * self.rng.uniform(0.67, 1.33)
            while at < end - a.period / 2:
                plan.append((at, "churn", -1))
                at += a.period * self.rng.uniform(0.67, 1.33)
            for j in range(a.joins):
                plan.append((t0 + (j + 1) / (a.joins + 1) * (end - t0 - a.settle), "join", a.groups + j))
            for r in range(a.retire):
                plan.append((t0 + (r + 1.5) / (a.retire + 1.5) * (end - t0) * 0.9, "retire", -1))
            for k in range(a.lighthouse_restarts):
                plan.append((t0 + (k + 1) / (a.lighthouse_restarts + 1) * (end - t0), "lighthouse", -1))
        plan.sort()
        pending: list[tuple[float, int]] = []  # (restart time, group)
        retired: set[int] = set()
        next_sample = 0.0
        while time.time() < end:
            now = time.time()
            if now >= next_sample:
                self.sample()
                next_sample = now + 5.0
            for when, group in [p for p in pending if p[0] <= now]:
                pending.remove((when, group))
                self.launch(group)
            while plan and plan[0][0] <= now:
                _, what, group = plan.pop(0)
                live = [g for g in self.procs if g not in retired and g < a.groups]
                if what == "churn" and live:
                    victim = self.rng.choice(live)
                    self.kill(victim)
                    back = time.time() + a.down * self.rng.uniform(0.25, 1.0)
                    if back < end - a.settle:  # (later, it would join as the others end: it stays down)
                        pending.append((back, victim))
                elif what == "retire" and live:
                    victim = self.rng.choice(live)
                    self.kill(victim)
                    retired.add(victim)
                elif what == "join":
                    self.launch(group)
                elif what == "lighthouse":
                    self.restart_lighthouse()
            for g, p in list(self.procs.items()):
                if p.poll() is not None:  # (a group that ended on its own: an error)
                    self.events.append((time.time(), f"exited {p.returncode}", g))
                    self.procs.pop(g)
            time.sleep(0.2)
        # The common last step: a sync or two past the furthest group.
        furthest = max((r["global_step"] for g in self.procs for r in records(self.out, g, f"-l{self.launches[g] - 1}")
                        [-1:]), default=0)
        stop = (furthest // a.sync_every + 2) * a.sync_every
        (self.out / "stop").write_text(str(stop))
        self.events.append((time.time(), f"stop at {stop}", -1))
        # A group still starting (no step yet) would join a job that ends: it finds no live group to heal from and no
        # quorum, and fails after quorum_timeout. Stopped here instead, and left out of the end's checks.
        for g in [g for g in self.procs if not records(self.out, g, f"-l{self.launches[g] - 1}")]:
            self.kill(g)
            self.events.append((time.time(), "still starting at the end: stopped", g))
        codes = {g: p for g, p in self.procs.items()}
        deadline = time.time() + 300 + a.quorum_timeout
        for g, p in codes.items():
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.kill(g)
        self.sample()
        self.stop_lighthouses()
        return self.results(t0, stop, {g: p.returncode for g, p in codes.items()})

    def results(self, t0: float, stop: int, codes: dict[int, int]) -> dict:
        a = self.args
        launches = []
        for g, n in self.launches.items():
            for k in range(n):
                rec = records(self.out, g, f"-l{k}")
                if rec:
                    launches.append((g, k, rec))
        t_end = max(r["time"] for _, _, rec in launches for r in rec)
        useful, blocked, lost = 0, [], 0
        stepping = 0.0  # group-seconds between each launch's first step and its last
        steps = [b["time"] - a_["time"] for _, _, rec in launches for a_, b in zip(rec, rec[1:])]
        step_s = statistics.median(steps) if steps else 0.0
        windows: dict[int, float] = {}
        for g, k, rec in launches:
            ended = (k == self.launches[g] - 1) and codes.get(g) == 0
            cut = len(rec)
            if not ended:  # (killed: its steps after its last committed sync are lost)
                last_commit = max((i for i in range(1, len(rec)) if rec[i]["ft/step"] > rec[i - 1]["ft/step"]),
                                  default=0)
                cut = last_commit + 1 if last_commit else 0
            kept = max(0, cut - int(rec[-1].get("ft/steps_lost", 0)))
            stepping += rec[-1]["time"] - rec[0]["time"]
            useful += kept * a.batch
            lost += len(rec) - kept
            for r in rec[:kept]:
                w = int((r["time"] - t0) // 20)
                windows[w] = windows.get(w, 0) + a.batch
            gaps = [(b["time"] - a_["time"], a_["global_step"]) for a_, b in zip(rec[1:], rec[2:])
                    if b["global_step"] == a_["global_step"] + 1]  # (a heal's jump excluded)
            if gaps:
                blocked.append((max(gaps)[0], g, k))
        params = {}
        for g in codes:
            path = self.out / f"params-{g}-l{self.launches[g] - 1}.pt"
            if path.exists():
                params[g] = torch.load(path)
        ref = next(iter(params.values()), None)
        # (with max_staleness, each group's last inner steps are in its parameters: the global copy is compared)
        keys = [k for k in (ref or {}) if k != "global_step" and (k.startswith("outer.") or not a.max_staleness)]
        equal = ref is not None and all(p["global_step"] == ref["global_step"] and all(
            torch.equal(p[key], ref[key]) for key in keys) for p in params.values())
        held_out = [held_out_loss(p, a.width) for p in params.values()]
        losses = [statistics.fmean(r["loss"] for r in rec[-10:]) for g, k, rec in launches
                  if k == self.launches[g] - 1 and codes.get(g) == 0]
        first_sync = []  # seconds from a (re)start to the launch's first committed sync
        starts = [(t, g) for t, what, g in self.events if what == "start"]
        for g, k, rec in launches:
            started = [t for t, gg in starts if gg == g][k]
            commit = next((r["time"] for r0, r in zip(rec, rec[1:]) if r["ft/step"] > r0["ft/step"]), None)
            if commit is not None and k > 0:
                first_sync.append(commit - started)
        heal_s = [rec[-1].get("ft/heal_s", 0.0) for g, k, rec in launches if k > 0]
        # Each launch's quorums: from its request to its answer, and what of it the training thread stood waiting
        # (seconds a quorum, the launch's mean; none counted by a version without these metrics)
        quorum = [(rec[-1]["ft/quorum_s"] / rec[-1]["ft/quorums"], rec[-1]["ft/quorum_wait_s"] / rec[-1]["ft/quorums"])
                  for g, k, rec in launches if rec[-1].get("ft/quorums")]
        return {"wall_s": t_end - t0, "useful_samples": useful, "goodput": useful / (t_end - t0), "stop": stop,
                "per_group_s": useful / stepping if stepping else 0.0,
                "step_s": step_s, "blocked_s": max(blocked, default=(0.0, -1, -1)), "lost_steps": lost,
                "equal": equal, "ended": len(params), "codes": codes, "final_loss": statistics.fmean(losses)
                if losses else float("nan"), "held_out": statistics.fmean(held_out) if held_out else float("nan"),
                "events": self.events, "windows": windows, "t0": t0,
                "first_sync_s": first_sync, "heal_s": heal_s, "quorum_s": quorum, "memory": self.samples,
                "launches": sum(self.launches.values())}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__, whole=True)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--rates", default="4x1gbit,8x100mbit,4x20mbit", help="each group node's link rate, in order")
    p.add_argument("--delays", default=None, help="each group node's one-way delay (e.g. 4x5ms,8x20ms,4x80ms); needs"
                   " netem")
    p.add_argument("--cpu", type=float, default=None, help="cores each group's node gets (default: the machine's"
                   " over the groups' nodes)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--period", type=float, default=30.0, help="seconds between kills (mean)")
    p.add_argument("--down", type=float, default=20.0, help="the longest a killed group stays down, seconds")
    p.add_argument("--settle", type=float, default=45.0, help="no group (re)starts in the run's last seconds: it"
                   " would join as the others end")
    p.add_argument("--joins", type=int, default=2)
    p.add_argument("--retire", type=int, default=2)
    p.add_argument("--lighthouse-restarts", type=int, default=2)
    p.add_argument("--standby", action="store_true", help="a standby lighthouse beside the first: each restart kills"
                   " the one in use, the groups going on with the other")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--compression", default=None)
    p.add_argument("--outer-optimizer", default=None, help="the sync mode's outer_optimizer (default: the strategy's,"
                   " nesterov)")
    p.add_argument("--compression-options", type=json.loads, default=None,
                   help='the codec\'s options, JSON (e.g. \'{"decay": 0.95}\': with --compression sparse and'
                   ' --outer-optimizer average, SparseLoCo\'s recipe)')
    p.add_argument("--max-staleness", type=int, default=0, help="the sync mode's max_staleness: a sync runs behind"
                   " this many inner steps (0: the inner steps wait for it)")
    p.add_argument("--sync-fragments", type=int, default=1, help="streaming DiLoCo's fragments")
    p.add_argument("--dynamic-steps", action="store_true", help="fault_tolerance's dynamic_steps: a sync is due when"
                   " the first group asks for it")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=15.0, help="the strategy's timeout: how long a quorum's members"
                   " wait for one that died after asking for it (torchft's rendezvous and collectives)")
    runs = ("no churn", "churn", "fast links")
    harness.add_names(p, "--runs", runs, runs)
    p.add_argument("--check", action="store_true", help="exit 1 unless every run ends with every group still"
                   " running equal bit for bit at the common step, each having exited 0, and no process went"
                   " longer than quorum_timeout plus a step without one (.ci/run's small run)")
    harness.add_common(p, out=harness.RESULTS / "churn.md", repeats=3, keep=True,
                       repeats_help="runs without churn (seeds 0..): the goodput compared to is their mean")
    args = p.parse_args(argv)
    args.runs = harness.names(p, args.runs, runs, "run")
    args.rate_list = rates_of(args.rates)
    if len(args.rate_list) != args.groups:
        p.error(f"--rates gives {len(args.rate_list)} rates for --groups {args.groups}")
    return args


def main(argv: list[str] | None = None) -> None:
    started = harness.start(__file__, argv, parse_args, cluster="fatal")
    args, bench = started
    from ddp_plugin.testing.simcluster import SimulatedCluster

    nodes = args.groups + args.joins + 1
    cpu = args.cpu or (os.cpu_count() or 1) / (nodes - 1)
    rows = {}
    names = [n for name in args.runs
             for n in ([f"no churn, seed {i}" for i in range(args.repeats)] if name == "no churn" else [name])]
    for name in names:
        fast = name == "fast links"
        rates = [args.rate_list[0]] * nodes if fast else [*args.rate_list, *[args.rate_list[0]] * (nodes - args.groups)]
        delays = None
        if args.delays:
            d = rates_of(args.delays)
            delays = [*d, *[d[0]] * (nodes - args.groups)]
        # (the lighthouse's node uncapped: it runs on a machine of its own, and its start at a group's share of a core
        # took 16 s, which a restart then cost every group)
        cpus = [*[cpu] * (nodes - 1), None]
        with SimulatedCluster(nodes=nodes, rate=rates, delay=delays, cpu=cpus, prefix="churn") as cluster, \
                harness.scratch("churn-", args.keep) as out:
            print(f"{name} in {out}", flush=True)
            seed = int(name.rsplit(" ", 1)[1]) if name.startswith("no churn, seed") else 0
            rows[name] = Run(cluster, args, out, name, seed).go(churn=name == "churn")
            print({k: v for k, v in rows[name].items() if k not in ("events", "windows", "memory")}, flush=True)
            if args.check and checks(rows[name], args):  # (what the groups said, before their folder goes)
                for log in sorted(out.glob("log*.txt")):
                    print(f"== {log.name}, its last lines:\n" + "\n".join(log.read_text().splitlines()[-15:]))
        write(args, bench, rows, cpu)
    if args.check:
        failures = [f"{name}: {why}" for name, r in rows.items() for why in checks(r, args)]
        if failures:
            raise SystemExit("benchmarks/churn.py --check failed:\n  " + "\n  ".join(failures))
        print("benchmarks/churn.py --check: every run ended equal, every group exited 0, no process blocked longer"
              f" than quorum_timeout ({args.quorum_timeout:g} s) plus a step")


def checks(r: dict, args: argparse.Namespace) -> list[str]:
    """What the run broke of :func:`main`'s ``--check``."""
    out = []
    if not r["equal"] or r["ended"] != len(r["codes"]):
        out.append(f"{r['ended']} of {len(r['codes'])} groups ended, {'equal' if r['equal'] else 'NOT equal'}")
    if any(code != 0 for code in r["codes"].values()):
        out.append(f"exit codes {r['codes']}")
    exited = [f"group {g} {what} at {t - r['t0']:.0f} s" for t, what, g in r["events"] if what.startswith("exited")]
    if exited:
        out.append("ended on their own mid-run: " + ", ".join(exited))
    if r["blocked_s"][0] > args.quorum_timeout + r["step_s"]:
        out.append(f"group {r['blocked_s'][1]} went {r['blocked_s'][0]:.1f} s without a step")
    return out


def write(args: argparse.Namespace, bench: harness.Run, rows: dict, cpu: float) -> None:
    clean = [r for name, r in rows.items() if name.startswith("no churn, seed")]
    base = statistics.fmean(r["goodput"] for r in clean) if clean else None
    base_live = statistics.fmean(r["per_group_s"] for r in clean) if clean else None
    cells = []
    for name, r in rows.items():
        mem = r["memory"]
        cells.append([name, f"{r['wall_s']:.0f}", r["launches"], f"{r['goodput']:.0f}",
                      f"{r['goodput'] / base:.3f}" if base else "-",
                      f"{r['per_group_s'] / base_live:.3f}" if base_live and r.get("per_group_s") else "-",
                      f"{r['blocked_s'][0]:.1f} (group {r['blocked_s'][1]})", f"{r['step_s']:.2f}",
                      f"{r['ended']} {'equal' if r['equal'] else 'NOT EQUAL'} at step {r['stop']}",
                      f"{r['final_loss']:.4f}", f"{r['held_out']:.6f}" if "held_out" in r else "-",
                      f"{min(m['lighthouse_mb'] for m in mem):.0f}-{max(m['lighthouse_mb'] for m in mem):.0f}",
                      f"{max(m['rank_mb'] for m in mem):.0f}",
                      f"{statistics.median(r['first_sync_s']):.0f}" if r["first_sync_s"] else "-"])
    lines = ["# Many groups that come and go", "", *bench.header(),
             f"- cluster: {args.groups} groups of one rank on nodes at {args.rates}"
             f"{f', delays {args.delays}' if args.delays else ' (no delays)'}, {args.joins} joining nodes and the"
             f" lighthouse's at {args.rate_list[0]}; every group's node held to {cpu:.3f} cores (a cgroup CPU quota), the"
             " lighthouse's not",
             f"- run: {route(args)}, MLP width {args.width},"
             f" batch"
             f" {args.batch}, {args.step_sleep} s of simulated compute a step, `data_split=\"quorum\"`, min_replicas"
             f" {args.groups // 2 + 1}, quorum_timeout {args.quorum_timeout:g} s, timeout {args.timeout:g} s,"
             f" {args.minutes:g} minutes a run;"
             f" churn: a kill every ~{args.period:g} s (back after up to {args.down:g} s), {args.joins} joins,"
             f" {args.retire} retired, the lighthouse killed and restarted {args.lighthouse_restarts} times"
             f"{' (with a standby: the one in use killed each time, the groups going on with the other)' if args.standby else ''}",
             "",
             *harness.table(["run", "wall (s)", "launches", "goodput (samples/s)", "against no churn",
                             "a running group's, against no churn",
                             "longest blocked (s)", "median step (s)", "groups at the end", "final loss",
                             "held-out loss of the final model",
                             "lighthouse RSS (MB)", "rank RSS max (MB)", "start to first sync (s, median)"],
                            cells, "l" * 12),
             "", "Coordination (each launch's mean a quorum, then the median over launches; a heal: a returning"
             " group's download of its peers' state, before its first step):", "",
             *harness.table(["run", "start to first sync (s, median)", "quorum: asked to answered (s)",
                             "of it the training thread waited (s)", "heals (median s, max s)"],
                            [coordination(name, r) for name, r in rows.items()], "lrrrr"),
             "", "Events of each run (seconds from the gate): "]
    for name, r in rows.items():
        ev = ", ".join(f"{t - r['t0']:.0f} {what}{f' {g}' if g >= 0 else ''}" for t, what, g in r["events"]
                       if t >= r["t0"])
        lines.append(f"- {name}: {ev}; exit codes {r['codes']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, default=str))
    png = Path(args.out).with_suffix(".png")
    also = [Path(args.out).with_suffix(".json")]
    if plot(rows, png):
        lines += ["", f"![goodput and membership over time]({png.name})"]
        also.append(png)
    harness.write(args.out, "\n".join(lines) + "\n", also=also)


def coordination(name: str, r: dict) -> list:
    def median(xs: list[float], digits: int = 2) -> str:
        return f"{statistics.median(xs):.{digits}f}" if xs else "-"

    quorum = r.get("quorum_s", [])
    heal = [h for h in r.get("heal_s", []) if h > 0]
    return [name, median(r["first_sync_s"], 0), median([q for q, _ in quorum], 3), median([w for _, w in quorum], 3),
            f"{len(heal)} ({median(heal, 1)}, {max(heal):.1f})" if heal else "0"]


def plot(rows: dict, png: Path) -> bool:
    plt = harness.pyplot()
    if plt is None:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, r in rows.items():
        windows = {int(k): v for k, v in r["windows"].items()}  # (str keys: rows read back from the JSON)
        w = sorted(windows)
        top.plot([k * 20 for k in w], [windows[k] / 20 for k in w], label=name)
        live, xs, ys = 0, [], []
        for t, what, _ in sorted(r["events"]):
            live += 1 if what == "start" else -1 if what == "kill" or what.startswith("exited") else 0
            xs.append(max(0.0, t - r["t0"]))
            ys.append(live)
        bottom.step(xs, ys, where="post", label=name)
    top.set_ylabel("useful samples/s (20 s windows)")
    bottom.set_ylabel("groups running")
    bottom.set_xlabel("seconds from the gate")
    top.legend(fontsize=7)
    harness.save_figure(fig, png)
    return True


if __name__ == "__main__":
    main()
