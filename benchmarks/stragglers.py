"""What a slow replica group costs the others, on the simulated cluster: DiLoCo across groups of one node at
100 Mbit/s, the last node's processes held to half a core (a cgroup CPU quota), the groups in lock-step (every sync
waits for the slowest) against ``dynamic_steps=True`` (a sync is due when the first group asks for it; a slower
group sends its own at the end of the step it is in, weighted by the steps it carries).

    sudo python benchmarks/stragglers.py                  # 2 nodes; writes benchmarks/results/stragglers.md

Each step is compute (the MLP of ``benchmarks/ft_worker.py`` at ``--width``, batch ``--batch``, one thread: no
simulated sleep), so half a core is half the speed. Per way (lock-step, dynamic) and throttle (none, the last node
at ``--quota`` of a core), one run of ``--steps`` steps reports node 0's throughput (its optimizer steps a second,
from its first sync to its end), what the slow node's throttle cost it against the same way unthrottled, the
steps each node ran (the slow node's skipped ones make up the rest), and each node's loss over its last 20 steps.

Needs root (network namespaces, cgroup v1's cpu controller); a benchmark, not a test: it asserts nothing. Run it on
a quiet machine with at least as many cores as nodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import harness
from harness import records, start_group, wait_all

CGROUP = Path("/sys/fs/cgroup/cpu")


class Quota:
    """A cgroup v1 CPU group holding its processes to ``share`` of a core."""

    def __init__(self, name: str, share: float) -> None:
        self.path = CGROUP / name
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text("100000")
        (self.path / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (CGROUP / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.path.rmdir()


def run(cluster, args, dynamic: bool, quota: Quota | None, out: Path) -> dict:
    n = cluster.nodes
    with harness.lighthouse(cluster, out, join_timeout_ms=60000, heartbeat_timeout_ms=2000) as address:
        procs = []
        for node in range(n):
            spec = {"sync_every": args.sync_every, "out": str(out), "node": node, "nodes": n, "steps": args.steps,
                    "lighthouse": address, "sleep": 0.0, "seed": 0, "gate": str(out / "gate"), "width": args.width,
                    "batch": args.batch, "compression": args.compression, "dynamic_steps": dynamic}
            proc = start_group(cluster, node, spec, out, 29600 + node)
            if quota is not None and node == n - 1:
                quota.add(proc.pid)
            procs.append(proc)
        harness.open_gate(out, [out / f"gate.{i}.0" for i in range(n)], procs)
        codes = wait_all(procs)
        found = [records(out, node) for node in range(n)]
        fast = found[0]
        # (from the first sync on: the first quorum forms once every node is set up and has run H steps)
        start = next(i for i, r in enumerate(fast) if r["global_step"] >= args.sync_every)
        window = fast[start:]
        steps_s = (len(window) - 1) / (window[-1]["time"] - window[0]["time"])
        return {"codes": codes, "steps_s": steps_s, "ran": [len(r) for r in found],
                "duration_s": fast[-1]["time"] - fast[0]["time"],
                "curve": [(r["time"] - fast[0]["time"], r["loss"]) for r in fast],
                "skipped": [r[-1].get("ft/steps_skipped", 0) for r in found],
                "early": [r[-1].get("ft/early_syncs", 0) for r in found],
                "loss": [statistics.mean(x["loss"] for x in r[-20:]) for r in found],
                "replicas": min(r.get("ft/replicas", 0) for r in window)}


def loss_at(curve: list[tuple[float, float]], seconds: float) -> float:
    """The mean loss over the 20 steps before ``seconds`` into a run."""
    before = [loss for t, loss in curve if t <= seconds]
    return statistics.mean(before[-20:])


WAYS = ("lockstep", "dynamic")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__, whole=True)
    harness.add_groups(p, nodes=2, steps=400, sync_every=40)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--compression", default="int8")
    p.add_argument("--quota", type=float, default=0.5, help="the slow node's share of a core")
    harness.add_names(p, "--ways", WAYS, WAYS)
    harness.add_common(p, out=harness.RESULTS / "stragglers.md", repeats=1, keep=True)
    args = p.parse_args(argv)
    args.ways = harness.names(p, args.ways, WAYS, "way")
    return args


def main(argv: list[str] | None = None) -> None:
    args, bench = harness.start(__file__, argv, parse_args, cluster="fatal")  # (exits where there is no cluster)
    if not (CGROUP / "cpu.cfs_quota_us").exists():
        sys.exit(f"needs cgroup v1's cpu controller at {CGROUP}")
    from ddp_plugin.testing.simcluster import SimulatedCluster

    rows = []
    with SimulatedCluster(nodes=args.nodes, rate=args.rate, prefix="slowbench") as cluster:
        for repeat in range(args.repeats):
            for way in args.ways:
                for throttled in (False, True):
                    quota = Quota("ddp_plugin_slow", args.quota) if throttled else None
                    try:
                        with harness.scratch("slow-", args.keep) as out:
                            result = run(cluster, args, way == "dynamic", quota, out)
                    finally:
                        if quota is not None:
                            quota.close()
                    print(way, "throttled" if throttled else "none",
                          json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
                    rows.append((way, repeat, throttled, result))
    # (every run's node-0 loss at the time the quickest run ended: the same wall-clock budget)
    budget = min(r["duration_s"] for _, _, _, r in rows)
    cells = []
    for way, repeat, throttled, r in rows:
        base = next(x for w, rp, t, x in rows if w == way and rp == repeat and not t)
        cells.append([way, repeat, f"at {args.quota:g} core" if throttled else "none", f"{r['steps_s']:.2f}",
                      f"{1 - r['steps_s'] / base['steps_s']:.1%}", f"{r['duration_s']:.1f}",
                      f"{loss_at(r['curve'], budget):.4f}", r["ran"], r["skipped"], r["early"],
                      ", ".join(f"{x:.4f}" for x in r["loss"]), r["codes"]])
    lines = [
        "# A slow replica group: what it costs the others",
        "",
        *bench.header(),
        f"- setup: DiLoCo (H={args.sync_every}, {args.compression}) across {args.nodes} groups of one node (one rank,"
        f" one thread), every link at {args.rate}; throttled: node {args.nodes - 1} held to {args.quota:g} of a core"
        " (cgroup CPU quota). Throughput: node 0's optimizer steps a second from its first sync to its end; cost: 1 -"
        " that over the same way's unthrottled run. Ran: the optimizer steps each node ran (skipped: the steps its"
        " schedule skipped to stand at its peers' step after a sync it sent early). Final loss: each node's mean over"
        " its last 20 steps; node 0's loss at the quickest run's length: its mean over the 20 steps before that time"
        " in its run (the same wall-clock budget)",
        "",
        *harness.table(["way", "repeat", "slow node", "node 0 (steps/s)", "cost to node 0", "node 0's run (s)",
                        f"node 0's loss at {budget:.1f} s", "steps ran", "skipped", "early syncs", "final loss",
                        "exit codes"], cells, "lrl" + "r" * 4 + "l" * 5),
    ]
    harness.write(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
