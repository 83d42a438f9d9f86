"""Goodput with groups that fail, return and join, on the simulated cluster: DiLoCo across replica groups of one
node at 100 Mbit/s (``--nodes`` 4). Groups 0 to N-2 start; group N-1, a new id, joins once node 0 reaches step J;
node N-2 is killed at step K1 and node N-3 at K2 (SIGKILL, every process in its namespace), each started again
``--down`` s later. The data is split by the quorum (``data_split="quorum"``), so a joining group takes a share.

    sudo python benchmarks/goodput.py                     # writes benchmarks/results/goodput.md

Runs, on the same cluster, steps and events:

- **background heal**: torchft, a returning or new group downloads its peers' state while they train (the default);
- **heal in the quorum**: the same with ``background_heal=False`` (the live groups wait for each heal);
- **no faults**: the join alone, ``--repeats`` runs from other initial parameters (their mean goodput is what the
  others are compared to; their final losses give the spread);
- **fail-fast + resume**: one torchrun job over the groups' nodes, a checkpoint every ``--ckpt-every`` steps: each
  kill fails every node, and the job is started again from ``last.ckpt``; adding the node is a restart too (the
  job stopped at J and started again over every node from its last checkpoint, on the larger world).

Goodput: useful samples a second, over the run's wall time (from the first launch to node 0's last step). Useful
samples: for torchft, node 0's steps weighted by the groups in its quorum at each (``ft/replicas``, as
``benchmarks/fault_tolerance.py`` counts replica-steps) times the batch; for fail-fast, each launch's steps that
the next launch did not redo, times its nodes, times the batch. Needs root (network namespaces); a benchmark, not
a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fault_tolerance import (  # noqa: E402
    WORKER,
    kill_node,
    launch_job,
    records,
    start_lighthouse,
    wait_all,
    wait_for_step,
    worker_env,
)


def events(args) -> tuple[int, int, int]:
    """The join step J and the two kill steps."""
    return args.steps // 5, int(args.steps * 0.4), int(args.steps * 0.65)


def run_torchft(cluster, args, out: Path, background: bool, faults: bool, seed: int = 0) -> dict:
    n = cluster.nodes
    lighthouse, address = start_lighthouse(cluster, out)
    base = {"out": str(out), "nodes": n - 1, "steps": args.steps, "lighthouse": address, "sleep": args.step_sleep,
            "sync_every": args.sync_every, "compression": "int8", "batch": args.batch, "data_split": "quorum",
            "background_heal": background, "seed": seed}

    def launch(node: int, tag: str = "", gate: bool = False) -> subprocess.Popen:
        spec = {**base, "node": node, "tag": tag, **({"gate": str(out / "gate")} if gate else {})}
        port = (29700 if tag else 29600) + node
        argv = [str(WORKER), json.dumps(spec)]
        if args.through_command:  # (as a user starts a group: the package's command, its flags)
            argv = ["-m", "ddp_plugin.fault_tolerance.launch", "--group", str(node), "--groups", str(n - 1),
                    "--lighthouse", address, "--master-addr", cluster.addresses[node], "--master-port", str(port),
                    *argv]
        return cluster.popen(node, [sys.executable, *argv], env=worker_env(cluster, node, port),
                             stdout=open(out / f"log{node}{tag}.txt", "w"), stderr=subprocess.STDOUT)

    started = time.time()
    procs = [launch(i, gate=True) for i in range(n - 1)]
    ready = [out / f"gate.{i}.0" for i in range(n - 1)]
    while not all(p.exists() for p in ready):
        if any(p.poll() is not None for p in procs) or time.time() > started + 300:
            raise RuntimeError(f"a node did not start; see the logs in {out}")
        time.sleep(0.05)
    (out / "gate").touch()
    join, *kills = events(args)
    result: dict = {"events": [], "stall_s": []}
    try:
        wait_for_step(out, 0, join, procs)
        procs.append(launch(n - 1))
        result["events"].append(("join", n - 1, time.time()))
        if faults:
            for i, kill_at in enumerate(kills):
                node = n - 2 - i
                wait_for_step(out, 0, kill_at, procs)
                killed = kill_node(cluster, node, procs[node])
                time.sleep(args.down)
                procs[node] = launch(node, "-back")
                result["events"].append(("kill", node, killed))
        result["codes"] = wait_all(procs)
        live = records(out, 0)
        step = statistics.median(b["time"] - a["time"] for a, b in zip(live, live[1:]))
        for what, _, at in result["events"]:
            after = [r for r in live if r["time"] > at]
            gaps = [b["time"] - a["time"] for a, b in zip(after, after[1:])][: 2 * args.sync_every + 2]
            result["stall_s"].append(max([after[0]["time"] - at, *gaps]) - step)
        result.update({"wall_s": live[-1]["time"] - started, "step_s": step,
                       "replica_steps": sum(r["ft/replicas"] for r in live),
                       "final_loss": statistics.fmean(r["loss"] for r in live[-10:])})
    finally:
        lighthouse.kill()
        lighthouse.wait()
    return result


def run_failfast(cluster, args, out: Path, port: int) -> dict:
    """Launches over nodes 0..m-1; each event ends the launch (a kill fails it, a join stops it) and the next
    starts from ``last.ckpt`` (over every node once the new one is added)."""
    n = cluster.nodes
    join, *kills = events(args)

    def launch(nodes: int, tag: str, resume: bool, port: int) -> list[subprocess.Popen]:
        spec = {"out": str(out), "steps": args.steps, "sync_every": args.sync_every, "compression": "int8",
                "batch": args.batch, "ckpt_every": args.ckpt_every, "resume": resume, "tag": tag,
                "sleep": args.step_sleep}
        return launch_job(cluster, out, nodes, 1, port, spec)

    started = time.time()
    plan = [(n - 1, join, None), (n, kills[0], n - 2), (n, kills[1], n - 3), (n, None, None)]
    useful, tag, procs = 0, "", None
    previous: tuple[int, str] | None = None  # (nodes, tag) of the launch before
    for i, (nodes, until, victim) in enumerate(plan):
        tag = f"-launch{i}"
        procs = launch(nodes, tag, i > 0, port + i)
        if until is not None:
            wait_for_step(out, 0, until, procs, tag)
            if victim is not None:
                kill_node(cluster, victim, procs[victim])
            else:
                for node, p in enumerate(procs):  # (adding a node: the job stopped, to start again over every node)
                    kill_node(cluster, node, p)
            wait_all(procs, timeout=300)
        else:
            wait_all(procs)
        done = records(out, 0, tag)
        first = done[0]["global_step"] - 1 if done else 0
        if previous is not None:
            # (the launch before ran up to `first`, the step it had checkpointed, for what is kept)
            before = records(out, 0, previous[1])
            useful += previous[0] * (first - (before[0]["global_step"] - 1 if before else 0))
        previous = (nodes, tag)
    last = records(out, 0, tag)
    useful += n * (last[-1]["global_step"] - (last[0]["global_step"] - 1))
    return {"codes": [p.returncode for p in procs], "wall_s": last[-1]["time"] - started, "replica_steps": useful,
            "final_loss": statistics.fmean(r["loss"] for r in last[-10:]), "stall_s": [], "events": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-sleep", type=float, default=0.05, help="a step's simulated compute, seconds")
    parser.add_argument("--ckpt-every", type=int, default=50)
    parser.add_argument("--down", type=float, default=5.0, help="seconds a killed node stays down")
    parser.add_argument("--runs", default="no faults,background heal,heal in the quorum,fail-fast + resume")
    parser.add_argument("--repeats", type=int, default=3, help="runs without faults (seeds 0..): the goodput"
                        " compared to is their mean, and their final losses give the spread")
    parser.add_argument("--through-command", action="store_true", help="start each torchft group with"
                        " `ddp-plugin-group` (python -m ddp_plugin.fault_tolerance.launch) instead of the worker itself")
    parser.add_argument("--keep", action="store_true", help="keep each run's logs (their folders are printed)")
    parser.add_argument("--out", default=str(HERE / "results" / "goodput.md"))
    args = parser.parse_args()

    from ddp_plugin.testing.simcluster import SimulatedCluster, available

    ok, why = available()
    if not ok:
        sys.exit(f"needs the simulated cluster: {why}")
    rows = {}
    with SimulatedCluster(nodes=args.nodes, rate=args.rate, prefix="goodput") as cluster:
        names = [n for name in args.runs.split(",")
                 for n in ([f"no faults, seed {i}" for i in range(args.repeats)] if name == "no faults" else [name])]
        for k, name in enumerate(names):
            out = Path(tempfile.mkdtemp(prefix="goodput-"))
            print(f"{name} in {out}", flush=True)
            if name == "fail-fast + resume":
                rows[name] = run_failfast(cluster, args, out, 29400 + 10 * k)
            else:
                clean = name.startswith("no faults")
                rows[name] = run_torchft(cluster, args, out, background=name != "heal in the quorum",
                                         faults=not clean, seed=int(name.rsplit(" ", 1)[1]) if clean else 0)
            rows[name]["goodput"] = rows[name]["replica_steps"] * args.batch / rows[name]["wall_s"]
            print(rows[name], flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
            write(args, rows)  # (after each run: what ran is kept if a later one fails)


def write(args, rows: dict) -> None:
    join, *kills = events(args)
    clean_runs = [r for name, r in rows.items() if name.startswith("no faults")]
    clean = statistics.fmean(r["goodput"] for r in clean_runs) if clean_runs else None
    lines = [
        "# Goodput with groups that fail, return and join",
        "",
        f"`python benchmarks/goodput.py --nodes {args.nodes} --rate {args.rate} --steps {args.steps} --sync-every"
        f" {args.sync_every} --batch {args.batch} --down {args.down}`, on {platform.node()} ({os.cpu_count()} CPUs),"
        f" {time.strftime('%Y-%m-%d')}, nothing else running. DiLoCo (`sync_every={args.sync_every}`, int8) across"
        f" replica groups of one node, links capped at {args.rate}, the MLP of `benchmarks/ft_worker.py` (width 128,"
        f" AdamW) at batch {args.batch}, {args.step_sleep} s of simulated compute a step, `data_split=\"quorum\"`."
        f" Groups 0-{args.nodes - 2} start; group {args.nodes - 1} (a new id) joins at node 0's step {join}; node"
        f" {args.nodes - 2} is killed at step {kills[0]} and node {args.nodes - 3} at step {kills[1]}, each started"
        f" again {args.down} s later. Fail-fast: one job, restarted from its last checkpoint (every"
        f" {args.ckpt_every} steps) at each kill and to add the node.",
        "",
        "| run | wall (s) | useful replica-steps | goodput (samples/s) | against no faults | node 0's longest stall"
        " beyond a step, per event (s) | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        ratio = f"{r['goodput'] / clean:.3f}" if clean else "-"
        stalls = ", ".join(f"{s:.2f}" for s in r["stall_s"]) or "-"
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['replica_steps']:.0f} | {r['goodput']:.0f} | {ratio} |"
                     f" {stalls} | {r['final_loss']:.4f} |")
    if clean_runs:
        losses = [r["final_loss"] for r in clean_runs]
        lines.append(f"| no faults, spread | | | {min(r['goodput'] for r in clean_runs):.0f} -"
                     f" {max(r['goodput'] for r in clean_runs):.0f} (mean {clean:.0f}) | | |"
                     f" {min(losses):.4f} - {max(losses):.4f} |")
    lines += ["", "Against no faults: the mean goodput of the runs without faults. Final loss: node 0's mean over its"
              " last 10 steps. Stalls, per event in order (the join, then each kill). Exit codes: "
              + "; ".join(f"{name}: {r['codes']}" for name, r in rows.items())]
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
