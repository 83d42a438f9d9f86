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
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fault_tolerance import WORKER, records, start_lighthouse, wait_all, worker_env  # noqa: E402

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
    lighthouse, address = start_lighthouse(cluster, out, join_timeout_ms=60000, heartbeat_timeout_ms=2000)
    try:
        procs = []
        for node in range(n):
            spec = {"sync_every": args.sync_every, "out": str(out), "node": node, "nodes": n, "steps": args.steps,
                    "lighthouse": address, "sleep": 0.0, "seed": 0, "gate": str(out / "gate"), "width": args.width,
                    "batch": args.batch, "compression": args.compression, "dynamic_steps": dynamic}
            proc = cluster.popen(node, [sys.executable, str(WORKER), json.dumps(spec)],
                                 env=worker_env(cluster, node, 29600 + node),
                                 stdout=open(out / f"log{node}.txt", "w"), stderr=subprocess.STDOUT)
            if quota is not None and node == n - 1:
                quota.add(proc.pid)
            procs.append(proc)
        deadline = time.time() + 300
        while not all((out / f"gate.{i}.0").exists() for i in range(n)):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a node did not start; see the logs in {out}")
            time.sleep(0.05)
        (out / "gate").touch()
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
    finally:
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()


def loss_at(curve: list[tuple[float, float]], seconds: float) -> float:
    """The mean loss over the 20 steps before ``seconds`` into a run."""
    before = [loss for t, loss in curve if t <= seconds]
    return statistics.mean(before[-20:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=40)
    parser.add_argument("--compression", default="int8")
    parser.add_argument("--quota", type=float, default=0.5, help="the slow node's share of a core")
    parser.add_argument("--ways", default="lockstep,dynamic")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep each run's directory (logs, records)")
    parser.add_argument("--out", default=str(HERE / "results" / "stragglers.md"))
    args = parser.parse_args()

    from ddp_plugin.testing.simcluster import SimulatedCluster, available

    ok, why = available()
    if not ok:
        sys.exit(f"needs the simulated cluster: {why}")
    if not (CGROUP / "cpu.cfs_quota_us").exists():
        sys.exit(f"needs cgroup v1's cpu controller at {CGROUP}")
    rows = []
    with SimulatedCluster(nodes=args.nodes, rate=args.rate, prefix="slowbench") as cluster:
        for repeat in range(args.repeats):
            for way in args.ways.split(","):
                for throttled in (False, True):
                    out = Path(tempfile.mkdtemp(prefix="slow-"))
                    quota = Quota("ddp_plugin_slow", args.quota) if throttled else None
                    try:
                        result = run(cluster, args, way == "dynamic", quota, out)
                    finally:
                        if quota is not None:
                            quota.close()
                        if args.keep:
                            print("kept", out, flush=True)
                        else:
                            shutil.rmtree(out, ignore_errors=True)
                    print(way, "throttled" if throttled else "none",
                          json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
                    rows.append((way, repeat, throttled, result))
    # (every run's node-0 loss at the time the quickest run ended: the same wall-clock budget)
    budget = min(r["duration_s"] for _, _, _, r in rows)
    lines = [
        "# A slow replica group: what it costs the others",
        "",
        f"`python benchmarks/stragglers.py --nodes {args.nodes} --rate {args.rate} --width {args.width} --batch"
        f" {args.batch} --steps {args.steps} --sync-every {args.sync_every} --compression {args.compression} --quota"
        f" {args.quota} --repeats {args.repeats}` on {platform.node()} ({os.cpu_count()} cores; nothing else"
        f" running), {time.strftime('%Y-%m-%d')}. DiLoCo (H={args.sync_every}, {args.compression}) across"
        f" {args.nodes} groups of one node (one rank, one thread), every link at {args.rate}; throttled: node"
        f" {args.nodes - 1} held to {args.quota:g} of a core (cgroup CPU quota). Throughput: node 0's optimizer steps"
        " a second from its first sync to its end; cost: 1 - that over the same way's unthrottled run. Ran: the"
        " optimizer steps each node ran (skipped: the steps its schedule skipped to stand at its peers' step after"
        " a sync it sent early). Final loss: each node's mean over its last 20 steps; node 0's loss at the quickest"
        " run's length: its mean over the 20 steps before that time in its run (the same wall-clock budget).",
        "",
        "| way | repeat | slow node | node 0 (steps/s) | cost to node 0 | node 0's run (s) |"
        f" node 0's loss at {budget:.1f} s | steps ran | skipped | early syncs | final loss | exit codes |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- |",
    ]
    for way, repeat, throttled, r in rows:
        base = next(x for w, rp, t, x in rows if w == way and rp == repeat and not t)
        cost = 1 - r["steps_s"] / base["steps_s"]
        lines.append(f"| {way} | {repeat} | {'at ' + format(args.quota, 'g') + ' core' if throttled else 'none'} |"
                     f" {r['steps_s']:.2f} | {cost:.1%} | {r['duration_s']:.1f} | {loss_at(r['curve'], budget):.4f} |"
                     f" {r['ran']} | {r['skipped']} | {r['early']} | {', '.join(f'{x:.4f}' for x in r['loss'])} |"
                     f" {r['codes']} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
