"""Nodes that come and go, on the simulated cluster: a whole node killed (SIGKILL, every process of it) at a random
step and started again, with ``fault_tolerance=`` (replica groups on torchft) against today's fail-fast + resume from
the last checkpoint, on the same script (``benchmarks/ft_worker.py``), the same cluster and the same step.

    sudo python benchmarks/fault_tolerance.py            # 3 nodes at 100 Mbit/s; writes benchmarks/results/fault_tolerance.md
    python benchmarks/fault_tolerance.py --nodes 4 --rate 1gbit --routes diloco

Per route (synchronous, DiLoCo with ``sync_every=10``, one rank per node; synchronous hierarchical with int8 across
nodes, two ranks per node), runs of ``--steps`` steps:

- **torchft**: the lighthouse in node 0's namespace, each node a replica group launched on its own; the last node
  is killed at step K and started again ``--down`` seconds later;
- **fail-fast + resume**: one torchrun job over every node, a checkpoint every ``--ckpt-every`` steps; the last
  node is killed at step K, the others fail (naming it), and the whole job is started again from ``last.ckpt``;
- **uninterrupted**: the torchft run without a kill, for the final loss.

Reported: the seconds the live nodes could not step (from the kill until their next step past the kill, less a
median step), the steps lost (committed nowhere, or redone after the resume), how long the returning node took
from its start to being in the quorum, the bytes its healing received, the final loss (mean of the last 10 steps),
and the wall time of the run; and, for a run with kills, the uninterrupted runs' loss after as many replica-steps
(a step of n live nodes is n of them; the mean of 10 steps there). The torchft runs start once every node is set
up. Needs root (network namespaces); a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

import harness
from harness import kill_node, launch_job, records, start_group, wait_all, wait_for_step

ROUTES = {
    "synchronous": {"sync_every": 1},
    "diloco": {"sync_every": 10},
    "hierarchical_int8": {"sync_every": 1, "devices": 2, "compression": "int8", "hierarchical": True},
    "streaming_int8": {"sync_every": 10, "sync_fragments": 5, "max_staleness": 1, "compression": "int8"},
}
"""Per route, the worker's spec: ``sync_every``, ranks per node (``devices``), ``compression``, ``hierarchical``,
``sync_fragments``, ``max_staleness``. (``streaming_int8`` is run on its own: ``--routes streaming_int8 --out
benchmarks/results/fault_tolerance_streaming.md``.)"""


def run_torchft(cluster, args, route: dict, out: Path, kills: list[int], seed: int = 0) -> dict:
    """The torchft run: every node set up before any steps (a gate), then node ``n - 1 - i`` killed once it
    reaches step ``kills[i]``, started again ``--down`` s later (tagged ``-back``)."""
    sync_every = route["sync_every"]
    n = cluster.nodes
    with harness.lighthouse(cluster, out) as address:

        def launch(node: int, tag: str = "") -> subprocess.Popen:
            spec = {**route, "out": str(out), "node": node, "nodes": n, "steps": args.steps, "lighthouse": address,
                    "tag": tag, "sleep": args.step_sleep, "seed": seed, "gate": str(out / "gate")}
            return start_group(cluster, node, spec, out, (29700 if tag else 29600) + node, tag)

        procs = [launch(i) for i in range(n)]
        started = harness.open_gate(out, [out / f"gate.{i}.{r}" for i in range(n) for r in range(route.get("devices", 1))],
                                    procs)
        result: dict = {"kills": kills, "stall_s": [], "rejoin_s": [], "healed_MB": []}
        events = []
        for i, kill_at in enumerate(kills):
            node = n - 1 - i
            wait_for_step(out, node, kill_at, procs)
            killed = kill_node(cluster, node, procs[node])
            time.sleep(args.down)
            procs[node] = launch(node, "-back")
            events.append((node, killed, time.time()))
        codes = wait_all(procs)
        live = records(out, 0)
        step = statistics.median(b["time"] - a["time"] for a, b in zip(live, live[1:]) if b["time"] < events[0][1]) \
            if events else float("nan")
        for node, killed, relaunched in events:
            after = [r for r in live if r["time"] > killed]
            gaps = [b["time"] - a["time"] for a, b in zip(after, after[1:])]
            result["stall_s"].append(max([after[0]["time"] - killed, *gaps[: 2 * sync_every + 2]]) - step)
            returned = records(out, node, "-back")
            joined = next((r for r in returned if r.get("ft/replicas", 0) == n), None)
            result["rejoin_s"].append(joined["time"] - relaunched if joined else float("nan"))
            result["healed_MB"].append(returned[-1]["ft/healed_MB"] if returned else float("nan"))
        result.update({"codes": codes, "step_s": step, "wall_s": live[-1]["time"] - started,
                       "steps_lost": live[-1]["ft/steps_lost"], "uncommitted": live[-1]["ft/uncommitted"],
                       # (the groups whose work each step applied: a step of n groups is n replica-steps)
                       "replica_steps": sum(r["ft/replicas"] for r in live),
                       "final_loss": statistics.fmean(r["loss"] for r in live[-10:]),
                       "curve": [(r["global_step"], r["loss"]) for r in live]})
    return result


def run_failfast(cluster, args, route: dict, out: Path, kills: list[int], port: int) -> dict:
    """Today's run: one torchrun job over every node, a checkpoint every ``--ckpt-every`` steps; at each kill the
    others fail and the job is started again from ``last.ckpt``."""
    n = cluster.nodes
    devices = route.get("devices", 1)

    def launch(tag: str, resume: bool, port: int) -> list[subprocess.Popen]:
        spec = {**route, "out": str(out), "steps": args.steps, "ckpt_every": args.ckpt_every, "resume": resume,
                "tag": tag, "sleep": args.step_sleep}
        return launch_job(cluster, out, n, devices, port, spec)

    started = time.time()
    procs, tag = launch("", False, port), ""
    result: dict = {"kills": kills, "stall_s": [], "steps_lost": 0, "detected_s": []}
    curve: list = []
    for i, kill_at in enumerate(kills):
        node = n - 1 - i
        wait_for_step(out, node, kill_at, procs, tag)
        killed = kill_node(cluster, node, procs[node])
        wait_all(procs, timeout=300)
        result["detected_s"].append(time.time() - killed)
        done = records(out, 0, tag)
        curve += [(r["global_step"], r["loss"]) for r in done]
        if i == 0:
            result["step_s"] = statistics.median(b["time"] - a["time"] for a, b in zip(done, done[1:]))
        tag = f"-resume{i}"
        procs = launch(tag, True, port + 1 + i)
        last_before = max(r["global_step"] for r in done)
        while not records(out, 0, tag) or max(r["global_step"] for r in records(out, 0, tag)) <= last_before:
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        resumed = records(out, 0, tag)
        past = next(r for r in resumed if r["global_step"] > last_before)
        result["stall_s"].append(past["time"] - killed - result["step_s"])
        result["steps_lost"] += last_before - (resumed[0]["global_step"] - 1)
    result["codes"] = wait_all(procs)
    final = records(out, 0, tag)
    curve += [(r["global_step"], r["loss"]) for r in final]
    result.update({"wall_s": final[-1]["time"] - started, "final_loss": statistics.fmean(r["loss"] for r in final[-10:]),
                   "curve": curve, "replica_steps": n * args.steps})
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__, whole=True)
    harness.add_groups(p, nodes=3, steps=600, step_sleep=0.05, down=5.0,
                       down_help="seconds a killed node stays down (torchft)", ckpt_every=50)
    harness.add_names(p, "--routes", ROUTES, "synchronous,diloco,hierarchical_int8")
    harness.add_common(p, out=harness.RESULTS / "fault_tolerance.md", repeats=3,
                       repeats_help="uninterrupted runs (seeds 0..), for the spread", keep=True)
    p.add_argument("--seed", type=int, default=0, help="draws the kill steps")
    args = p.parse_args(argv)
    args.routes = harness.names(p, args.routes, ROUTES, "route")
    return args


def main(argv: list[str] | None = None) -> None:
    args, bench = harness.start(__file__, argv, parse_args, cluster="fatal")  # (exits where there is no cluster)
    from ddp_plugin.testing.simcluster import SimulatedCluster

    rng = random.Random(args.seed)
    rows = {}
    with SimulatedCluster(nodes=args.nodes, rate=args.rate, prefix="ftbench") as cluster:
        for k, route in enumerate(args.routes):
            spec = ROUTES[route]
            # Two failures and two returns: node N-1 early, node N-2 once the first is back.
            kills = [rng.randrange(args.steps // 6, args.steps // 4), rng.randrange(args.steps // 2, 2 * args.steps // 3)]
            runs = {}
            for name in ["torchft", "failfast", *(f"uninterrupted, seed {i}" for i in range(args.repeats))]:
                with harness.scratch(f"ft-{route}-{name.split(',')[0]}-", args.keep) as out:
                    print(f"{route}: {name} (kills at steps {kills}) in {out}", flush=True)
                    if name == "torchft":
                        runs[name] = run_torchft(cluster, args, spec, out, kills)
                    elif name == "failfast":
                        runs[name] = run_failfast(cluster, args, spec, out, kills, 29400 + 10 * k)
                    else:
                        runs[name] = run_torchft(cluster, args, spec, out, [], seed=int(name.rsplit(" ", 1)[1]))
                print({key: v for key, v in runs[name].items() if key != "curve"}, flush=True)
            rows[route] = runs
    write(args, bench, rows)
    write_plot(args, rows, Path(args.out).with_suffix(".png"))


def loss_at(curve: list, step: float, window: int = 10) -> float:
    """The mean loss of the ``window`` steps up to ``step`` (as the final loss is the mean of the last 10)."""
    values = [loss for s, loss in curve if step - window < s <= step]
    return statistics.fmean(values) if values else float("nan")


def _list(values, fmt: str) -> str:
    return ", ".join(format(v, fmt) for v in values) if values else "-"


def write(args: argparse.Namespace, bench: harness.Run, rows: dict) -> None:
    lines = [
        "# Nodes that come and go: torchft replica groups against fail-fast + resume",
        "",
        *bench.header(),
        f"- routes: {', '.join(f'{r} {ROUTES[r]}' for r in rows)}; gloo, links capped at {args.rate}, a 2-layer MLP"
        f" (width 128, AdamW) on the sine task, {args.step_sleep} s of simulated compute a step. Node N-1, then node"
        " N-2, is killed (SIGKILL, every process in its namespace) at the steps shown; torchft: started again after"
        f" {args.down} s; fail-fast: every node fails, and the job is started again from the last checkpoint"
        f" (every {args.ckpt_every} steps)",
        "",
    ]
    cells = []
    for route, runs in rows.items():
        clean = [r for name, r in runs.items() if name.startswith("uninterrupted")]
        for name, r in runs.items():
            same = ""
            if clean and r.get("kills"):
                # The uninterrupted runs' loss after as many replica-steps as this run made (n per step).
                at = [loss_at(c["curve"], r["replica_steps"] / args.nodes) for c in clean]
                same = f"{min(at):.4f} - {max(at):.4f} (step {r['replica_steps'] / args.nodes:.0f})"
            cells.append([route, name, _list(r.get("kills"), "d"), _list(r.get("stall_s"), ".2f"),
                          r.get("steps_lost", "-") if r.get("kills") else "-", f"{r.get('step_s', float('nan')):.3f}",
                          _list(r.get("rejoin_s"), ".1f"), _list(r.get("healed_MB"), ".3f"),
                          f"{r.get('replica_steps', float('nan')):.0f}", f"{r['final_loss']:.4f}", same,
                          f"{r['wall_s']:.1f}"])
        if clean:
            losses = [r["final_loss"] for r in clean]
            cells.append([route, "uninterrupted spread", "", "", "", "", "", "", "",
                          f"{min(losses):.4f} - {max(losses):.4f}"])
    lines += harness.table(["route", "run", "killed at step", "live nodes stalled (s)", "steps lost", "a step (s)",
                            "back in the quorum (s)", "healing received (MB)", "replica-steps", "final loss",
                            "uninterrupted, same replica-steps", "wall (s)"], cells, "l" * 12)
    lines += ["", "Exit codes: " + "; ".join(f"{route} {name}: {r['codes']}" for route, runs in rows.items()
                                             for name, r in runs.items())]
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows))
    harness.write(args.out, "\n".join(lines) + "\n", also=[Path(args.out).with_suffix(".json")])


def write_plot(args: argparse.Namespace, rows: dict, path: Path) -> None:
    """Loss (a running mean over 25 steps) against the step, per route: each run, the kills marked."""
    plt = harness.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(7 * len(rows), 4.5), squeeze=False)
    for ax, (route, runs) in zip(axes[0], rows.items()):
        for name, r in runs.items():
            steps = [s for s, _ in r["curve"]]
            losses = [v for _, v in r["curve"]]
            smooth = [statistics.fmean(losses[max(0, i - 24): i + 1]) for i in range(len(losses))]
            style = {"torchft": ("tab:blue", "-"), "failfast": ("tab:red", "-")}.get(name, ("0.6", ":"))
            ax.plot(steps, smooth, color=style[0], ls=style[1], lw=1.2, label=name)
        for kill in runs["torchft"].get("kills", []):
            ax.axvline(kill, color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("global step (dashed: a node killed)")
        ax.set_ylabel("training loss (running mean of 25 steps)")
        ax.set_title(f"{route} ({args.nodes} nodes, {args.rate})")
        ax.legend(fontsize=8)
    harness.save_figure(fig, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
