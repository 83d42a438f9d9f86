"""Offload benchmark: ZeRO-3 with ``offload="disk"`` on a model whose training state is >= 4x each rank's memory cap,
against the same run without offload on a machine with room.

    python benchmarks/offload.py                                   # the 244M GPT, cap 960 MiB, 3 steps
    python benchmarks/offload.py --d-model 1024 --layers 6 --cap-mb 0 --runs plain,disk_inbw

Each run is one launch of ``tests/workers/offload_run.py`` (4 CPU ranks, a GPT built on meta with Lightning's
``init_module(empty_init=True)``, AdamW, ``auto_wrap_policy=["Block"]``, ``prefetch_units=1``), each rank in a memory
cgroup of its own: capped at ``--cap-mb`` from its start, imports included, for the offload runs; only measured for
``plain``. Reported per run: the cap, the training state (weights, gradients and AdamW's two moments, fp32: 16 bytes a
parameter) against it, each rank's peak charge while setting up and while stepping (the cgroup's, page cache
included), the median step time of the steps after the first, and whether every rank's losses and final parameter
checksum equal ``plain``'s. This is a benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import harness

RUNS = {
    "plain": ("no offload, no cap", ["--offload", "none"]),
    "disk": ('`offload="disk"`, `offload_params=True`', ["--offload", "disk"]),
    "disk_inbw": ('`offload="disk"`, `offload_params=True`, `optimizer_in_backward=True`',
                  ["--offload", "disk", "--in-backward"]),
}
WORKER = harness.ROOT / "tests" / "workers" / "offload_run.py"
MIB = 1 << 20


def run(name: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    out = tmp / f"{name}.json"
    cap = [] if name == "plain" or not args.cap_mb else ["--cap-mb", str(args.cap_mb)]
    cmd = [sys.executable, str(WORKER), "--out", str(out), "--name", f"bench_{name}", "--d-model",
           str(args.d_model), "--layers", str(args.layers), "--steps", str(args.steps), "--dir", args.dir or
           str(tmp / "offload"), *RUNS[name][1], *cap]
    try:
        harness.run_local(cmd, timeout=3600, env=harness.RANK_ENV).check(name)
    finally:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_cgroup", harness.ROOT / "ddp_plugin" / "testing" / "cgroup.py")
        module = sys.modules["_cgroup"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.remove([f"bench_{name}_{rank}" for rank in range(4)])
    return json.loads(out.read_text())


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    bench = harness.Run(__file__, argv, quiet=args.quiet, ranks=4)
    results: dict[str, list[dict]] = {}
    with harness.scratch("offload", keep=args.keep) as tmp:
        for name in args.runs:
            results[name] = run(name, args, tmp)
            r = results[name]
            print(f"{name}: peaks {[max(x['step_peaks']) // MIB for x in r]} MiB, step"
                  f" {statistics.median(s for x in r for s in x['step_s'][1:]):.1f} s", flush=True)
    first = next(iter(results.values()))[0]
    reference = results.get("plain")
    rows = []
    base = statistics.median(s for r in reference for s in r["step_s"][1:]) if reference is not None else 0.0
    for name, ranks in results.items():
        cap = ranks[0]["cap"] if name != "plain" and args.cap_mb else None
        step = statistics.median(s for r in ranks for s in r["step_s"][1:])
        same = "(reference)" if name == "plain" else "-" if reference is None else (
            "yes" if [r["losses"] for r in ranks] == [r["losses"] for r in reference]
            and [r["checksum"] for r in ranks] == [r["checksum"] for r in reference] else "NO")
        rows.append([RUNS[name][0], "-" if cap is None else f"{cap // MIB}",
                     "-" if cap is None else f"{ranks[0]['state_bytes'] / cap:.2f}",
                     ", ".join(str(r["setup_peak"] // MIB) for r in ranks),
                     ", ".join(str(max(r["step_peaks"]) // MIB) for r in ranks),
                     f"{max(max(r['step_peaks']) for r in ranks) / ranks[0]['share_bytes']:.2f}",
                     str(sum(r["oom_kills"] for r in ranks)), f"{step:.1f}",
                     "-" if reference is None else f"{step / base:.2f}",
                     same])
    lines = [
        "# Offload benchmark: ZeRO-3 with the training state on disk, under a per-rank memory cap",
        "",
        *bench.header(),
        f"- model: GPT, d_model {args.d_model}, {args.layers} blocks, vocab 32, built on meta;"
        f" {first['params'] / 1e6:.0f}M parameters; training state (fp32 weights, gradients, AdamW's two moments) {first['state_bytes'] / MIB:.0f}"
        f" MiB, a rank's share {first['share_bytes'] / MIB:.0f} MiB; 4 CPU ranks, ZeRO-3, `prefetch_units=1`,"
        f" {args.steps} steps of 4 x 8 tokens a rank",
        "- peaks: each rank's cgroup charge (anonymous memory and page cache), MiB, while setting up (build,"
        " materialize, shard) and while stepping; imports included",
        "- step: median over the ranks' steps after the first; vs plain: that over plain's",
        "",
        *harness.table(["run", "cap MiB", "state / cap", "setup peak MiB (ranks)", "step peak MiB (ranks)",
                        "step peak / share", "OOM kills", "step s", "vs plain", "same losses and weights"], rows),
    ]
    harness.write(args.out, "\n".join(lines) + "\n", show=False)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__, whole=True)
    harness.add_names(p, "--runs", RUNS, RUNS)
    p.add_argument("--d-model", type=int, default=1280)
    p.add_argument("--layers", type=int, default=13)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cap-mb", type=int, default=960, help="each offload run's per-rank cap, MiB (0: none)")
    p.add_argument("--dir", default=None, help="offload_dir (default: a scratch directory)")
    harness.add_common(p, out=harness.RESULTS / "offload.md", keep=True)
    args = p.parse_args(argv)
    args.runs = harness.names(p, args.runs, RUNS, "run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    driver(args, sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
