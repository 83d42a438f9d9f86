"""What a returning replica group's healing costs the live ones, on the simulated cluster: DiLoCo across groups of
one node (or of ``--nodes-per-group`` nodes, a rank each: the last node killed, its group's other nodes ending by
themselves), the last group started again, healing in the background (``background_heal=True``, the
default) against inside its first quorum (``background_heal=False``, the live groups waiting), at model sizes
whose heal moves tens of MB a rank.

    sudo python benchmarks/heal_stall.py                       # 3 nodes at 100 Mbit/s; writes benchmarks/results/heal_stall.md
    python benchmarks/heal_stall.py --widths 1600,2400 --rate 100mbit --repeats 2
    python benchmarks/heal_stall.py --nodes 4 --nodes-per-group 2   # 2 groups of 2 nodes

Per width (the MLP of ``benchmarks/ft_worker.py``, two hidden layers of that width: about 2 width^2 parameters) and
way, one run of ``--steps`` steps (``sync_every=--sync-every``), the last node killed at ``--kill-at`` and started
again ``--down`` seconds later, reports:

- the bytes its healing received (a rank: 8 bytes a parameter in the background, 20 inside the quorum);
- **a sync's step**: the live node's longest interval before the kill (a sync's, whose pseudo-gradients cross the
  link: what a stall is to be compared with, besides the median step);
- **stall**: the most any of the live node's steps took, from the relaunch until ``--after`` steps past the returning
  node's first step in the quorum, beyond what that step usually takes (a sync's step: the median of the syncs
  outside that window; any other: the median step before the kill), in seconds and in median steps;
- **rejoin**: from the relaunch to the returning node's first step counted in the quorum;
- the heal's own time on the returning node (``ft/heal_s``, background only).

Needs root (network namespaces); a benchmark, not a test: it asserts nothing. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import harness
from harness import kill_node, records, start_group, wait_all, wait_for_step


def run(cluster, args, width: int, background: bool, out: Path) -> dict:
    n, per = cluster.nodes, args.nodes_per_group
    groups = n // per
    lost = list(range(n - per, n))  # the last group's nodes; the last of them is killed
    with harness.lighthouse(cluster, out) as address:

        def launch(node: int, tag: str = "") -> subprocess.Popen:
            group = node // per
            spec = {"sync_every": args.sync_every, "out": str(out), "node": node, "nodes": n, "steps": args.steps,
                    "lighthouse": address, "tag": tag, "sleep": args.step_sleep, "seed": 0, "gate": str(out / "gate"),
                    "width": width, "background_heal": background, "group": group, "groups": groups,
                    "group_nodes": per, "node_rank": node % per}
            # (the group's first node: its own rendezvous)
            return start_group(cluster, node, spec, out, (29700 if tag else 29600) + group, tag,
                               master=cluster.addresses[group * per])

        procs = [launch(i) for i in range(n)]
        harness.open_gate(out, [out / f"gate.{i}.0" for i in range(n)], procs)
        first = lost[0]  # (the group's records are its first node's)
        wait_for_step(out, first, args.kill_at, procs)
        killed = kill_node(cluster, lost[-1], procs[lost[-1]])
        for node in lost[:-1]:  # the group's other nodes end by themselves, naming the lost rank
            try:
                procs[node].wait(timeout=120)
            except subprocess.TimeoutExpired:
                print(f"node {node} did not end within 120 s of its group's loss: killed", flush=True)
                kill_node(cluster, node, procs[node])
        lost_codes = [procs[node].returncode for node in lost]
        time.sleep(args.down)
        relaunched = time.time()
        for node in lost:
            procs[node] = launch(node, "-back")
        codes = wait_all(procs) + lost_codes
        live = records(out, 0)
        gaps = [(b["time"] - a["time"], a["time"], b["global_step"]) for a, b in zip(live, live[1:])]
        step = statistics.median(g for g, t, _ in gaps if t < killed)
        back = records(out, first, "-back")
        joined = next((r for r in back if r.get("ft/replicas", 0) == groups), None)
        until = (joined["time"] if joined else live[-1]["time"]) + args.after * step
        # A sync's step takes its pseudo-gradients across the link: what each step normally takes, a sync's (the
        # median of the syncs outside the heal's window, the run's first left out: every group but one heals in
        # it) or the median step, is subtracted from each step of the window.
        syncs = [g for g, t, s in gaps if s % args.sync_every == 0 and s > args.sync_every and not relaunched <= t <= until]
        sync_step = statistics.median(syncs) if syncs else float("nan")
        window = [(g, s) for g, t, s in gaps if relaunched <= t <= until]
        extra = max((g - (sync_step if s % args.sync_every == 0 else step) for g, s in window), default=float("nan"))
        if syncs == [] or joined is None:
            extra = float("nan")  # (no sync outside the window to compare a sync's step with)
        stall = max((g for g, _ in window), default=float("nan"))
        return {"codes": codes, "step_s": step, "sync_step_s": sync_step, "stall_s": stall, "extra_s": extra,
                "extra_x": extra / step,
                "rejoin_s": joined["time"] - relaunched if joined else float("nan"),
                "healed_MB": back[-1]["ft/healed_MB"] if back else float("nan"),
                "heal_s": back[-1].get("ft/heal_s", float("nan")) if back else float("nan"),
                "background": back[-1].get("ft/background_heals", 0) if back else 0,
                "params_M": (2 * width * width + 12 * width + 1) / 1e6}


WAYS = ("background", "quorum")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__, whole=True)
    harness.add_groups(p, nodes=3, steps=240, sync_every=40, step_sleep=0.2, down=10.0,
                       down_help="seconds the killed node stays down (past the sync the kill fails, so that its stall"
                                 " is not counted as the heal's)")
    p.add_argument("--nodes-per-group", type=int, default=1, help="nodes a replica group spans (one launch"
                   " over them, a rank a node); the last group loses its last node")
    p.add_argument("--widths", default="1600,2400", help="the MLP's hidden width per size (comma-separated)")
    p.add_argument("--kill-at", type=int, default=45)
    p.add_argument("--after", type=int, default=25, help="steps of the live node past the returning node's"
                   " join that the stall is looked for in")
    harness.add_names(p, "--ways", WAYS, WAYS, help="which ways to heal (comma-separated)")
    harness.add_common(p, out=harness.RESULTS / "heal_stall.md", repeats=1, keep=True)
    args = p.parse_args(argv)
    if args.nodes % args.nodes_per_group or args.nodes // args.nodes_per_group < 2:
        p.error(f"--nodes {args.nodes} must be at least 2 groups of --nodes-per-group {args.nodes_per_group}")
    args.ways = harness.names(p, args.ways, WAYS, "way")
    return args


def main(argv: list[str] | None = None) -> None:
    args, bench = harness.start(__file__, argv, parse_args, cluster="fatal")  # (exits where there is no cluster)
    from ddp_plugin.testing.simcluster import SimulatedCluster

    rows, per = [], args.nodes_per_group
    with SimulatedCluster(nodes=args.nodes, rate=args.rate, prefix="healbench") as cluster:
        for width in [int(w) for w in harness.split(args.widths)]:
            for repeat in range(args.repeats):
                for background in [way == "background" for way in args.ways]:
                    with harness.scratch("heal-", args.keep) as out:
                        result = run(cluster, args, width, background, out)
                    name = f"width {width}, {'background' if background else 'in the quorum'}"
                    print(name, json.dumps(result), flush=True)
                    rows.append((name, repeat, result))
    lines = [
        "# A returning group's healing: what it costs the live groups",
        "",
        *bench.header(),
        f"- setup: DiLoCo (H={args.sync_every}) across {args.nodes // per} groups of {per} node{'s' * (per > 1)} (a"
        f" rank a node), every link at {args.rate}; node {args.nodes - 1} killed at step {args.kill_at}"
        f"{' (its group peers end by themselves)' if per > 1 else ''}, its group started again {args.down:g} s"
        f" later. Window: node 0's steps from the relaunch to {args.after} steps past the returning group's join."
        " Stall: the most any step of the window took beyond what it usually takes (a sync's step: the median of"
        " the syncs outside the window, the run's first left out; any other: the median step before the kill)",
        "",
        *harness.table(["run", "repeat", "parameters (M)", "healed (MB a rank)", "heal (s)", "median step (s)",
                        "a sync's step (s)", "longest step in the window (s)", "stall: beyond its usual (s)",
                        "stall (x median step)", "rejoin (s)", "exit codes"],
                       ([name, repeat, f"{r['params_M']:.1f}", f"{r['healed_MB']:.1f}", f"{r['heal_s']:.1f}",
                         f"{r['step_s']:.2f}", f"{r['sync_step_s']:.2f}", f"{r['stall_s']:.2f}", f"{r['extra_s']:.2f}",
                         f"{r['extra_x']:.1f}", f"{r['rejoin_s']:.1f}", r["codes"]] for name, repeat, r in rows),
                       "l" + "r" * 10 + "l"),
    ]
    harness.write(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
