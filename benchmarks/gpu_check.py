"""The GPU check: ``hierarchical_zero`` against Lightning's ``ddp`` on NCCL ranks, one per GPU (or on CPU ranks).

    python benchmarks/gpu_check.py                                   # every GPU (NCCL), when CUDA has 2 or more
    python benchmarks/gpu_check.py --accelerator cpu --devices 2     # 2 CPU ranks over gloo (how it is tested)
    python benchmarks/gpu_check.py --sections parity --cases default,int8,zero3 --steps 30 --out check.json

For a machine with two or more GPUs, which the project's own machines do not have: the paths the CPU suite checks
(gloo) run here on NCCL, with the same expectations. Every case is a real multi-rank fit under Lightning's own
launcher (``benchmarks/gpu_check_worker.py``, which Lightning re-executes once per rank; the cases of a section
run one after another in the same processes, a new launch only after a case crashed or hung). Sections:

1. ``parity``: the tiny tied-embedding GPT (``ddp_plugin.testing.gpt``, 4 blocks), AdamW, gradient clipping at
   0.3 by the global norm, the same global batch of 4 samples per rank at every step, ``--steps`` steps, trained
   with Lightning's ``ddp`` and with ``hierarchical_zero`` under one feature at a time. Checked per case: the
   data-parallel replicas hold the same bits (C1), every loss is finite, and against ``ddp`` (``16-mixed``: against
   ``ddp`` under ``16-mixed``) the tolerance the docs give the feature:

   - ``default``, ``zero1``-``zero3``, ``zero3_offload_cpu`` (the state in pinned host memory, copied to the device
     for each bucket's step), ``16-mixed``: largest |parameter - ddp's| <= 1e-5 (C2, docs/design.md);
   - ``tp2``, ``pp2`` (tensor / pipeline parallel size 2; the data-parallel ranks read the whole global batch):
     largest difference over the tensor's largest value <= 3e-4 (docs/pipeline.md; tests/test_tensor_parallel.py);
   - the codecs, lossy by design (``fp16``, ``bf16``, ``int8``, ``topk``, ``powersgd``; with one node the codec
     compresses every bucket): the share of ddp's loss decrease the codec's run reaches by the last step,
     (first loss - its last loss) / (first loss - ddp's last loss), at least 0.99 for fp16 and bf16, 0.97 for
     int8, 0.75 for powersgd (10 plain steps first), 0.1 for topk (1 % of the values a step). These floors are
     this script's: docs/compression.md's C3 tolerances are for 150 steps of another model, and top-k needs far
     more steps than a check takes to catch up; what they catch is a codec that does not train on these ranks
     (a wrong stream order, garbage on the wire, NaN), while C1 catches one whose ranks disagree.

2. ``overlap``: an MLP (``--overlap-hidden`` wide, ``--overlap-layers`` hidden layers) with
   ``accumulate_grad_batches=2``: every backward timed from ``on_before_backward`` to ``on_after_backward`` (CUDA
   events on a GPU, ``perf_counter`` on a CPU), the first micro-batch of a step without the gradient sync (DDP's
   ``no_sync``, the strategy's accumulation), the second with it; medians over the steps after the warmup, then
   over ``--repeats`` runs of each, alternating. Printed: both times and their ratio for ``ddp`` and for ours, and
   the strategy's own ``comm/hidden_share`` (with ``comm/time_ms`` and ``comm/wait_ms``). Checked: ours'
   synchronized backward takes at most ``--overlap-max-ratio`` (1.5) times ddp's.

3. ``kill``: ``hierarchical_zero`` with ``--timeout`` (20 s) fitting on every rank; rank ``--kill-rank`` (the last
   one) kills itself with SIGKILL at the start of step ``--kill-step``. Checked (C5, docs/failures.md): the run
   exits non-zero, every survivor that says why it stops names the dead rank ("... failed because rank N stopped
   responding ..."), and the last survivor has exited within the timeout of the kill.

Each check prints a PASS, FAIL or SKIP line; the summary counts them; the exit code is 1 if any check failed. With
``--out`` the whole report is written as JSON. ``--devices 1`` runs one rank (what a one-GPU machine can host):
the comparison with ``ddp`` on one rank, no tensor or pipeline parallelism, no kill.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

WORKER = harness.HERE / "gpu_check_worker.py"
SECTIONS = ("parity", "overlap", "kill")

EXACT = ("default", "zero1", "zero2", "zero3", "16-mixed", "zero3_offload_cpu")
LAYOUTS = ("tp2", "pp2")
CODECS = ("fp16", "bf16", "int8", "topk", "powersgd")
PARITY_CASES = (*EXACT[:1], *CODECS, *EXACT[1:4], *EXACT[5:], *LAYOUTS, "16-mixed")
ATOL = 1e-5  # C2: N ranks equal one process on the concatenated batch (docs/design.md)
RTOL = 3e-4  # tensor and pipeline parallelism against ddp (docs/pipeline.md, tests/test_tensor_parallel.py)
LOSS_SHARE = {"fp16": 0.99, "bf16": 0.99, "int8": 0.97, "powersgd": 0.75, "topk": 0.1}
"""The least share of ddp's loss decrease a codec's run must reach (see the module's docstring)."""


# ---------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.epilog = "\n".join(__doc__.splitlines()[1:])
    p.add_argument("--accelerator", choices=["gpu", "cpu"], default=None,
                   help="gpu: NCCL ranks, one per GPU; cpu: gloo ranks (default: gpu when CUDA has 2 or more devices)")
    p.add_argument("--devices", type=int, default=None, help="ranks (default: every GPU, or 2 CPU ranks)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--cases", default=",".join(PARITY_CASES),
                   help=f"parity cases, comma-separated subset of {', '.join(PARITY_CASES)}")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per parity case")
    p.add_argument("--overlap-steps", type=int, default=20, help="timed optimizer steps per overlap run")
    p.add_argument("--overlap-warmup", type=int, default=3, help="untimed optimizer steps before them")
    p.add_argument("--overlap-hidden", type=int, default=None, help="MLP width (default: 4096 on GPUs, 512 on CPUs)")
    p.add_argument("--overlap-layers", type=int, default=None, help="hidden layers (default: 8 on GPUs, 4 on CPUs)")
    harness.add_common(p, out=None, out_help="write the report as JSON here", repeats=2,
                       repeats_help="overlap runs of each strategy, alternating", keep=True, quiet=False)
    p.add_argument("--overlap-max-ratio", type=float, default=1.5,
                   help="ours' synchronized backward may take at most this many times ddp's")
    p.add_argument("--kill-rank", type=int, default=None, help="the rank the kill section kills (default: the last)")
    p.add_argument("--kill-step", type=int, default=3, help="the step at whose start it dies")
    p.add_argument("--timeout", type=float, default=20.0, help="the kill section's collective timeout, seconds")
    p.add_argument("--case-timeout", type=float, default=600.0,
                   help="seconds a case (with its launch's start) may run before it counts as hung and its launch's"
                   " processes are killed")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if bad := [s for s in sections if s not in SECTIONS]:
        p.error(f"--sections: {bad} not in {', '.join(SECTIONS)}")
    cases = [c for c in args.cases.split(",") if c]
    if bad := [c for c in cases if c not in PARITY_CASES]:
        p.error(f"--cases: {bad} not in {', '.join(PARITY_CASES)}")
    args.sections, args.cases = sections, cases
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.accelerator is None:
        args.accelerator = "gpu" if gpus >= 2 else "cpu"
    if args.devices is None:
        args.devices = gpus if args.accelerator == "gpu" else 2
    if args.devices < 1:
        p.error("--devices must be at least 1")
    if args.accelerator == "gpu" and args.devices > gpus:
        p.error(f"--devices {args.devices} on GPUs, but CUDA sees {gpus} (one NCCL rank per GPU; "
                "`--accelerator cpu` runs gloo ranks)")
    if args.steps < 2 or args.overlap_steps < 1 or args.repeats < 1 or args.kill_step < 1:
        p.error("--steps takes at least 2, --overlap-steps, --repeats and --kill-step at least 1")
    if args.kill_rank is None:
        args.kill_rank = args.devices - 1
    if not 0 <= args.kill_rank < args.devices:
        p.error(f"--kill-rank {args.kill_rank}: a rank from 0 to {args.devices - 1}")
    gpu = args.accelerator == "gpu"
    args.overlap_hidden = args.overlap_hidden or (4096 if gpu else 512)
    args.overlap_layers = args.overlap_layers or (8 if gpu else 4)
    return args


# ---------------------------------------------------------------------------------------------- the report


class Report:
    """Checks as they are made: each printed at once as a ``PASS``/``FAIL``/``SKIP`` line."""

    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.sections: dict[str, dict] = {}

    def check(self, section: str, name: str, ok: bool | None, detail: str) -> None:
        status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        self.checks.append({"section": section, "name": name, "status": status, "detail": detail})
        print(f"{status}  {section}/{name}: {detail}", flush=True)

    def failed(self) -> int:
        return sum(c["status"] == "FAIL" for c in self.checks)

    def summary(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for c in self.checks:
            counts = out.setdefault(c["section"], {"PASS": 0, "FAIL": 0, "SKIP": 0})
            counts[c["status"]] += 1
        return out


def info(text: str) -> None:
    print(f"      {text}", flush=True)


# ---------------------------------------------------------------------------------------------- launches

_ERROR = re.compile(r"\b\w*(Error|Exception)\b: |Forcefully terminating|[Ww]atchdog caught|terminated with code")


def error_lines(log: str, last: int = 3) -> list[str]:
    """The distinct lines of ``log`` that look like an exception's message (or Lightning's launcher ending the
    other ranks, or NCCL's watchdog), the last ``last`` of them; C++ stack frames left out."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln).strip() for ln in log.splitlines()]
    found = list(dict.fromkeys(ln for ln in lines if _ERROR.search(ln) and not ln.startswith("frame #")))
    return [ln if len(ln) <= 300 else ln[:297] + "..." for ln in found[-last:]]


def launch(spec: dict, folder: Path, cap_s: float, watch=None) -> tuple[int | None, str, bool]:
    """One launch of the worker (Lightning's launcher starts the other ranks from it) with ``spec``, its output in
    ``folder/log``. ``watch(proc)`` is called every 50 ms and may return True to stop waiting. Returns the exit
    code (None: killed by this script), the log, and whether a case of it ran longer than ``cap_s`` (counted
    from the launch, then from each ``== case`` line rank 0 prints). Nothing is left running."""
    from ddp_plugin.testing.processes import end_run

    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(folder)}
    log_path = folder / "log"
    started = time.time()
    hung = False
    cases_seen = 0
    proc = harness.spawn([sys.executable, str(WORKER), "--spec", json.dumps(spec)], log_path)
    try:
        while proc.poll() is None:
            if watch is not None and watch(proc):
                break
            if time.time() - started > cap_s:
                seen = log_path.read_text(errors="replace").count("== case ")
                if seen == cases_seen:
                    hung = True
                    break
                cases_seen, started = seen, time.time()
            time.sleep(0.05)
    finally:
        end_run(proc, folder)
    returncode = None if hung else proc.returncode
    return returncode, log_path.read_text(errors="replace"), hung


def results(folder: Path) -> list[dict]:
    """The results rank 0 appended to ``folder/result.jsonl``, one per finished case, in order."""
    path = folder / "result.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def run_cases(section: str, cases: list[str], spec: dict, folder: Path, cap_s: float) -> dict[str, dict]:
    """Every case of ``cases`` in as few launches as possible: a launch fits them in order; a case that crashes or
    hangs its launch fails, and the cases after it run in a new launch."""
    done: dict[str, dict] = {}
    failed: dict[str, str] = {}
    todo = list(cases)
    attempt = 0
    while todo:
        attempt += 1
        sub = folder / f"launch{attempt}"
        keys = [f"{c}#{i}" for i, c in enumerate(todo)] if len(set(todo)) < len(todo) else todo
        started = time.time()
        returncode, log, hung = launch({**spec, "section": section, "cases": todo}, sub, cap_s)
        got = results(sub)
        for key, r in zip(keys, got):
            done[key] = {**r, "folder": str(sub)}
        todo, keys = todo[len(got):], keys[len(got):]
        if not todo:
            if returncode not in (0, None) or hung:
                info(f"(the launch ended with exit code {returncode} after its last case)")
            break
        why = (f"hung: still running after {cap_s:.0f} s (killed)" if hung
               else f"its launch exited with code {returncode} after {time.time() - started:.0f} s")
        errors = error_lines(log)
        failed[keys[0]] = why + ("; " + " | ".join(errors) if errors else "") + f" (log: {sub / 'log'} with --keep)"
        info(f"case {todo[0]} failed: {failed[keys[0]]}")
        todo = todo[1:]
    for key, why in failed.items():
        done[key] = {"case": key.split("#")[0], "error": why}
    return done


# ---------------------------------------------------------------------------------------------- parity


def parity(args: argparse.Namespace, base: dict, folder: Path, report: Report) -> None:
    import torch

    cases = list(args.cases)
    if args.devices % 2 or args.devices < 2:
        for case in [c for c in cases if c in LAYOUTS]:
            report.check("parity", case, None, f"needs an even number of ranks, at least 2 (--devices {args.devices})")
            cases.remove(case)
    references = ["ddp"] + (["ddp:16-mixed"] if "16-mixed" in cases else [])
    started = time.time()
    runs = run_cases("parity", references + cases, {**base, "steps": args.steps}, folder, args.case_timeout)
    each = ", ".join(f"{c} {r['seconds']:.1f} s" for c, r in runs.items() if "seconds" in r)
    info(f"{len(references) + len(cases)} fits in {time.time() - started:.0f} s (fit times: {each})")
    rows = {}

    def load(case: str) -> dict[str, torch.Tensor] | None:
        r = runs.get(case, {})
        path = Path(r["folder"]) / f"{case}.pt" if "folder" in r else None
        return torch.load(path) if path is not None and path.exists() else None

    for reference in references:
        r = runs[reference]
        if "error" in r:
            report.check("parity", reference, False, f"the reference did not train: {r['error']}")
        else:
            ok = r["replicas_identical"] and all(map(math.isfinite, r["losses"]))
            report.check("parity", reference, ok, f"Lightning's own strategy on {r['backend']} ({r['device']}):"
                         f" loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, replicas identical:"
                         f" {r['replicas_identical']}")
    for case in cases:
        r = runs[case]
        reference = "ddp:16-mixed" if case == "16-mixed" else "ddp"
        ref = runs[reference]
        if "error" in r:
            report.check("parity", case, False, r["error"])
            rows[case] = {"error": r["error"]}
            continue
        if "error" in ref:
            report.check("parity", case, None, f"no reference ({reference} failed)")
            continue
        mine, theirs = load(case), load(reference)
        if mine is None or theirs is None or mine.keys() != theirs.keys():
            keys = sorted(set(mine or {}) ^ set(theirs or {}))
            report.check("parity", case, False, f"the parameters cannot be compared with {reference}'s"
                         f" (names only in one of them: {keys[:6]})")
            continue
        abs_diff = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
        rel_diff = max(float((mine[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-30)) for k in mine)
        losses, ref_losses = r["losses"], ref["losses"]
        finite = all(map(math.isfinite, losses)) and all(math.isfinite(float(v.abs().max())) for v in mine.values())
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        ref_decrease = ref_losses[0] - ref_losses[-1]
        share = (losses[0] - losses[-1]) / ref_decrease if ref_decrease else math.nan
        row = {"max_abs_diff": abs_diff, "max_rel_diff": rel_diff, "replicas_identical": r["replicas_identical"],
               "first_loss": losses[0], "last_loss": losses[-1], "reference_last_loss": ref_losses[-1],
               "max_step_loss_gap": loss_gap, "loss_decrease_share": share, "reference": reference,
               "seconds": r["seconds"]}
        diff = "bit-equal" if abs_diff == 0 else f"max |param - {reference}| {abs_diff:.2e} (relative {rel_diff:.2e})"
        c1 = "replicas identical" if r["replicas_identical"] else "REPLICAS DIFFER (C1)"
        if case in EXACT:
            ok = abs_diff <= ATOL
            row["check"] = f"max |param - {reference}| <= {ATOL:g} (C2)"
            detail = f"{diff} <= {ATOL:g} (C2)" if ok else f"{diff} > {ATOL:g} (C2)"
        elif case in LAYOUTS:
            ok = rel_diff <= RTOL
            row["check"] = f"max |param - {reference}| / max |param| <= {RTOL:g} per tensor"
            detail = f"{diff}; relative {rel_diff:.2e} {'<=' if ok else '>'} {RTOL:g}"
        else:
            floor = LOSS_SHARE[case]
            ok = share >= floor
            row["check"] = f"share of ddp's loss decrease >= {floor:g}"
            detail = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (ddp -> {ref_losses[-1]:.4f}): {share:.3f} of ddp's"
                      f" decrease {'>=' if ok else '<'} {floor:g}; largest step gap {loss_gap:.2%}; {diff}")
        ok = ok and r["replicas_identical"] and finite
        rows[case] = {**row, "status": "PASS" if ok else "FAIL"}
        report.check("parity", case, ok, f"{detail}; {c1}" + ("" if finite else "; NOT FINITE"))
    report.sections["parity"] = {"steps": args.steps, "references": {c: runs[c] for c in references},
                                 "cases": rows}


# ---------------------------------------------------------------------------------------------- overlap


def overlap(args: argparse.Namespace, base: dict, folder: Path, report: Report) -> None:
    cases = ["ddp", "ours"] * args.repeats
    spec = {**base, "steps": args.overlap_steps, "warmup": args.overlap_warmup, "hidden": args.overlap_hidden,
            "layers": args.overlap_layers}
    runs = run_cases("overlap", cases, spec, folder, args.case_timeout)
    timer = "CUDA events" if args.accelerator == "gpu" else "perf_counter"
    by: dict[str, list[dict]] = {"ddp": [], "ours": []}
    for key, r in runs.items():
        if "error" in r:
            report.check("overlap", key, False, r["error"])
        else:
            by[r["case"]].append(r)
    if not by["ddp"] or not by["ours"]:
        report.check("overlap", "measured", False, "no run of one of the strategies finished")
        report.sections["overlap"] = {"runs": runs}
        return
    row: dict[str, dict] = {}
    for name, rs in by.items():
        synced = statistics.median(statistics.median(r["synced_s"]) for r in rs)
        unsynced = statistics.median(statistics.median(r["unsynced_s"]) for r in rs)
        row[name] = {"synced_ms": synced * 1e3, "unsynced_ms": unsynced * 1e3, "ratio": synced / unsynced,
                     "per_run_synced_ms": [statistics.median(r["synced_s"]) * 1e3 for r in rs],
                     "per_run_unsynced_ms": [statistics.median(r["unsynced_s"]) * 1e3 for r in rs]}
    metrics = {k: statistics.median(r["metrics"].get(k, math.nan) for r in by["ours"])
               for k in ("comm/hidden_share", "comm/time_ms", "comm/wait_ms")}
    grad_mb = by["ours"][0]["grad_MB"]
    info(f"MLP 64 -> {args.overlap_layers + 1} x {args.overlap_hidden} -> 10, {grad_mb:.1f} MB of fp32 gradients,"
         f" 16 samples per rank and micro-batch, accumulate_grad_batches=2; backward timed with {timer}, median of"
         f" {args.overlap_steps} steps after {args.overlap_warmup}, median of {args.repeats} run(s) each")
    for name, label in (("ddp", "ddp              "), ("ours", "hierarchical_zero")):
        v = row[name]
        info(f"{label} backward without sync {v['unsynced_ms']:8.2f} ms, with sync {v['synced_ms']:8.2f} ms,"
             f" ratio {v['ratio']:.2f} (runs with sync: {', '.join(f'{t:.2f}' for t in v['per_run_synced_ms'])} ms)")
    info("hierarchical_zero's own metrics (per-step means, rank 0): comm/hidden_share"
         f" {metrics['comm/hidden_share']:.3f}, comm/time_ms {metrics['comm/time_ms']:.2f},"
         f" comm/wait_ms {metrics['comm/wait_ms']:.2f}"
         + (" (the library's own clock; where it reads the host's, on NCCL it times the enqueueing, not the"
            " GPU: the CUDA-event times above are this section's measurement)" if args.accelerator == "gpu" else ""))
    ok_measured = all(math.isfinite(v["synced_ms"]) and v["synced_ms"] > 0 and v["unsynced_ms"] > 0
                      for v in row.values())
    report.check("overlap", "measured", ok_measured,
                 f"backward with and without the sync timed for both ({timer})")
    ratio = row["ours"]["synced_ms"] / row["ddp"]["synced_ms"]
    report.check("overlap", "vs ddp", ratio <= args.overlap_max_ratio,
                 f"ours' backward with sync {row['ours']['synced_ms']:.2f} ms = {ratio:.2f} x ddp's"
                 f" {row['ddp']['synced_ms']:.2f} ms ({'<=' if ratio <= args.overlap_max_ratio else '>'}"
                 f" {args.overlap_max_ratio:g})")
    report.sections["overlap"] = {"timer": timer, "grad_MB": grad_mb, "ddp": row["ddp"], "ours": row["ours"],
                                  "ours_vs_ddp_synced": ratio, "metrics": metrics}


# ---------------------------------------------------------------------------------------------- kill

_EXIT_LINE = re.compile(r"rank (\d+) exits after [\d.]+ s \(at ([\d.]+)\): (.*)$")


def kill(args: argparse.Namespace, base: dict, folder: Path, report: Report) -> None:
    from ddp_plugin.testing.processes import alive, pid_files

    if args.devices < 2:
        report.check("kill", "names the dead rank", None, "needs at least 2 ranks")
        return
    dead = args.kill_rank
    spec = {**base, "section": "kill", "cases": ["kill"], "fault_rank": dead, "fault_step": args.kill_step,
            "timeout": args.timeout}
    marks: dict[str, float] = {}

    def watch(proc: subprocess.Popen) -> bool:
        fault = folder / "fault"
        if "fault" not in marks and fault.exists() and (text := fault.read_text().split()):
            marks["fault"] = float(text[0])
        if "fault" not in marks:
            return False
        others = [pid for rank, pid in pid_files(folder).items() if rank != dead]
        if not any(alive(pid) for pid in others):
            marks["ended"] = time.time()
            return True
        if time.time() - marks["fault"] > args.timeout + 60:
            marks["hung"] = time.time()
            return True
        return False

    # (the launcher itself is rank 0: wait for it too, whatever the watch says)
    returncode, log, hung = launch(spec, folder, args.case_timeout, watch)
    fault_at = marks.get("fault")
    if fault_at is None:
        report.check("kill", "the fault", False, f"rank {dead} never reached step {args.kill_step} (exit code"
                     f" {returncode}{', hung' if hung else ''}): {' | '.join(error_lines(log)) or 'no error line'}")
        report.sections["kill"] = {"returncode": returncode, "log": str(folder / "log")}
        return
    ended = marks.get("ended") or marks.get("hung") or time.time()
    seconds = ended - fault_at
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in log.splitlines()]
    exits = {}
    for ln in lines:
        if (m := _EXIT_LINE.search(ln)) and int(m.group(1)) != dead:
            exits[int(m.group(1))] = {"after_s": float(m.group(2)) - fault_at, "message": m.group(3)}
    named = {r: bool(re.search(rf"(because|after) rank {dead} (stopped responding|failed)", e["message"]))
             for r, e in exits.items()}
    blamed = {r: sorted(set(re.findall(r"because rank (\d+)", e["message"])) - {str(dead)}) for r, e in exits.items()}
    survivors = [r for r in range(args.devices) if r != dead]
    silent = [r for r in survivors if r not in exits]
    for r, e in sorted(exits.items()):
        msg = e["message"] if len(e["message"]) <= 240 else e["message"][:237] + "..."
        info(f"rank {r} raised {e['after_s']:.2f} s after the kill: {msg}")
    if silent:
        info(f"survivors that printed no exit line (killed by the launcher, or still running): {silent};"
             f" last error lines: {' | '.join(error_lines(log)) or 'none'}")
    report.check("kill", "exit code", returncode not in (0, None) and not hung,
                 f"the launch exited with code {returncode}" + (" (killed by this script: hung)" if hung else ""))
    ok = bool(exits) and all(named.values()) and not any(blamed.values())
    report.check("kill", "names the dead rank", ok,
                 f"{sum(named.values())} of {len(survivors)} survivor(s) name rank {dead}"
                 + (f"; blamed instead: {blamed}" if any(blamed.values()) else "")
                 + (f"; {len(silent)} said nothing" if silent else ""))
    report.check("kill", "time to fail", not marks.get("hung") and seconds <= args.timeout,
                 f"the last survivor was gone {seconds:.1f} s after the kill (timeout {args.timeout:g} s)")
    report.sections["kill"] = {"dead_rank": dead, "step": args.kill_step, "timeout_s": args.timeout,
                               "returncode": returncode, "seconds_to_last_exit": seconds, "survivors": exits,
                               "silent": silent}


# ---------------------------------------------------------------------------------------------- main


def environment(args: argparse.Namespace) -> dict:
    """The machine and software of the report (harness.machine()), the devices, the checkout."""
    import torch

    env = {**harness.machine(), "cpus": os.cpu_count(), "accelerator": args.accelerator, "devices": args.devices,
           "backend": "nccl" if args.accelerator == "gpu" else "gloo"}
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informative only
            pass
    env["revision"] = harness.revision()
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    env = environment(args)
    print(f"gpu_check: {args.devices} {args.accelerator.upper()} rank(s) over {env['backend']}"
          + (f" ({', '.join(env['gpus'][:args.devices])})" if args.accelerator == "gpu" else "")
          + f"; torch {env['torch']}, lightning {env['lightning']}, revision {env['revision']}", flush=True)
    base = {"accelerator": args.accelerator, "devices": args.devices}
    report = Report()
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    times = {}
    try:
        for section in args.sections:
            print(f"\n== {section}", flush=True)
            t0 = time.time()
            {"parity": parity, "overlap": overlap, "kill": kill}[section](args, base, scratch / section, report)
            times[section] = time.time() - t0
    finally:
        if args.keep:
            print(f"\nlaunch folders kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = report.summary()
    total = time.time() - started
    print("\n== summary")
    for section in args.sections:
        counts = summary.get(section, {"PASS": 0, "FAIL": 0, "SKIP": 0})
        print(f"{section:<8} {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
              f" ({times.get(section, 0):.0f} s)")
    passed = sum(c["status"] == "PASS" for c in report.checks)
    skipped = sum(c["status"] == "SKIP" for c in report.checks)
    print(f"gpu_check: {passed} passed, {report.failed()} failed, {skipped} skipped in {total:.0f} s"
          f" -> {'FAIL' if report.failed() else 'PASS'}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)],
            "environment": env, "seconds": total, "section_seconds": times, "summary": summary,
            "result": "FAIL" if report.failed() else "PASS", "checks": report.checks, "sections": report.sections,
        }, indent=2, default=str))
        print(f"written to {args.out}")
    return 1 if report.failed() else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a terminated run still cleans up its launches
    sys.exit(main())
