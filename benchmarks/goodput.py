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
import statistics
import subprocess
import time
from pathlib import Path

import harness
from harness import kill_node, launch_job, records, start_group, wait_all, wait_for_step


def events(args: argparse.Namespace) -> tuple[int, int, int]:
    """The join step J and the two kill steps."""
    return args.steps // 5, int(args.steps * 0.4), int(args.steps * 0.65)


def run_torchft(cluster, args, out: Path, background: bool, faults: bool, seed: int = 0) -> dict:
    n = cluster.nodes
    with harness.lighthouse(cluster, out) as address:
        base = {"out": str(out), "nodes": n - 1, "steps": args.steps, "lighthouse": address, "sleep": args.step_sleep,
                "sync_every": args.sync_every, "compression": "int8", "batch": args.batch, "data_split": "quorum",
                "background_heal": background, "seed": seed}

        def launch(node: int, tag: str = "", gate: bool = False) -> subprocess.Popen:
            spec = {**base, "node": node, "tag": tag, **({"gate": str(out / "gate")} if gate else {})}
            port = (29700 if tag else 29600) + node
            prefix = []
            if args.through_command:  # (as a user starts a group: the package's command, its flags)
                prefix = ["-m", "ddp_plugin.fault_tolerance.launch", "--group", str(node), "--groups", str(n - 1),
                          "--lighthouse", address, "--master-addr", cluster.addresses[node], "--master-port", str(port)]
            return start_group(cluster, node, spec, out, port, tag, prefix)

        started = time.time()
        procs = [launch(i, gate=True) for i in range(n - 1)]
        harness.open_gate(out, [out / f"gate.{i}.0" for i in range(n - 1)], procs)
        join, *kills = events(args)
        result: dict = {"events": [], "stall_s": []}
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


RUNS = ("no faults", "background heal", "heal in the quorum", "fail-fast + resume")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__, whole=True)
    harness.add_groups(p, nodes=4, steps=800, sync_every=10, step_sleep=0.05, down=5.0, ckpt_every=50)
    p.add_argument("--batch", type=int, default=32)
    harness.add_names(p, "--runs", RUNS, RUNS)
    p.add_argument("--through-command", action="store_true", help="start each torchft group with"
                   " `ddp-plugin-group` (python -m ddp_plugin.fault_tolerance.launch) instead of the worker itself")
    harness.add_common(p, out=harness.RESULTS / "goodput.md", repeats=3, keep=True,
                       repeats_help="runs without faults (seeds 0..): the goodput compared to is their mean, and their"
                                    " final losses give the spread")
    args = p.parse_args(argv)
    args.runs = harness.names(p, args.runs, RUNS, "run")
    return args


def main(argv: list[str] | None = None) -> None:
    args, bench = harness.start(__file__, argv, parse_args, cluster="fatal")  # (exits where there is no cluster)
    from ddp_plugin.testing.simcluster import SimulatedCluster

    rows = {}
    with SimulatedCluster(nodes=args.nodes, rate=args.rate, prefix="goodput") as cluster:
        names = [n for name in args.runs
                 for n in ([f"no faults, seed {i}" for i in range(args.repeats)] if name == "no faults" else [name])]
        for k, name in enumerate(names):
            with harness.scratch("goodput-", args.keep) as out:
                print(f"{name} in {out}", flush=True)
                if name == "fail-fast + resume":
                    rows[name] = run_failfast(cluster, args, out, 29400 + 10 * k)
                else:
                    clean = name.startswith("no faults")
                    rows[name] = run_torchft(cluster, args, out, background=name != "heal in the quorum",
                                             faults=not clean, seed=int(name.rsplit(" ", 1)[1]) if clean else 0)
            rows[name]["goodput"] = rows[name]["replica_steps"] * args.batch / rows[name]["wall_s"]
            print(rows[name], flush=True)
            write(args, bench, rows)  # (after each run: what ran is kept if a later one fails)


def write(args: argparse.Namespace, bench: harness.Run, rows: dict) -> None:
    join, *kills = events(args)
    clean_runs = [r for name, r in rows.items() if name.startswith("no faults")]
    clean = statistics.fmean(r["goodput"] for r in clean_runs) if clean_runs else None
    cells = []
    for name, r in rows.items():
        cells.append([name, f"{r['wall_s']:.1f}", f"{r['replica_steps']:.0f}", f"{r['goodput']:.0f}",
                      f"{r['goodput'] / clean:.3f}" if clean else "-", ", ".join(f"{s:.2f}" for s in r["stall_s"]) or "-",
                      f"{r['final_loss']:.4f}"])
    if clean_runs:
        losses = [r["final_loss"] for r in clean_runs]
        cells.append(["no faults, spread", "", "", f"{min(r['goodput'] for r in clean_runs):.0f} -"
                      f" {max(r['goodput'] for r in clean_runs):.0f} (mean {clean:.0f})", "", "",
                      f"{min(losses):.4f} - {max(losses):.4f}"])
    lines = [
        "# Goodput with groups that fail, return and join",
        "",
        *bench.header(),
        f"- setup: DiLoCo (`sync_every={args.sync_every}`, int8) across replica groups of one node, links capped at"
        f" {args.rate}, the MLP of `benchmarks/ft_worker.py` (width 128, AdamW) at batch {args.batch}, {args.step_sleep}"
        f" s of simulated compute a step, `data_split=\"quorum\"`. Groups 0-{args.nodes - 2} start; group"
        f" {args.nodes - 1} (a new id) joins at node 0's step {join}; node {args.nodes - 2} is killed at step {kills[0]}"
        f" and node {args.nodes - 3} at step {kills[1]}, each started again {args.down} s later. Fail-fast: one job,"
        f" restarted from its last checkpoint (every {args.ckpt_every} steps) at each kill and to add the node",
        "",
        *harness.table(["run", "wall (s)", "useful replica-steps", "goodput (samples/s)", "against no faults",
                        "node 0's longest stall beyond a step, per event (s)", "final loss"], cells, "l" * 7),
        "",
        "Against no faults: the mean goodput of the runs without faults. Final loss: node 0's mean over its"
        " last 10 steps. Stalls, per event in order (the join, then each kill). Exit codes: "
        + "; ".join(f"{name}: {r['codes']}" for name, r in rows.items()),
    ]
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows))
    harness.write(args.out, "\n".join(lines) + "\n", also=[Path(args.out).with_suffix(".json")])


if __name__ == "__main__":
    main()
