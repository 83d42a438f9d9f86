"""The fault matrix: how ``hierarchical_zero`` and Lightning's ``ddp`` behave when a run breaks, on the same script.

    python benchmarks/faults.py                       # every fault; writes benchmarks/results/faults.md
    python benchmarks/faults.py --only sigstop,nan    # names containing these words
    python benchmarks/faults.py --only mesh --out benchmarks/results/faults_mesh.md   # the 3-D mesh's rows

Each fault is one run of ``benchmarks/fault_worker.py`` per contender: 4 CPU ranks over gloo under Lightning's own
launcher (ours as 2 simulated nodes of 2 ranks, ``devices_per_node=2``, unless the row says one node), a small
MLP with AdamW, 12 steps. The worker injects the fault and writes the time it did (``fault``); this driver then
watches every rank's process and reports the seconds from the fault until the last of the other ranks exited, and
the line of the output that tells the user what happened. A run whose processes outlive the cap is reported as a
hang and killed. Faults that need root (a full or read-only filesystem: a small tmpfs) are skipped with the reason
where it cannot be mounted.

This is a benchmark, not a test: it asserts nothing. Times depend on the machine; say how busy it was.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import harness
from ddp_plugin.testing.processes import alive, end_run, kill_quietly, pid_files

WORKER = harness.HERE / "fault_worker.py"
TIMEOUT_S = 20  # the collective timeout both contenders get
CAP_S = 120  # seconds after the fault (or the start) before a run counts as hung


@dataclass
class Run:
    """What one contender's run did."""

    returncode: int | None
    seen: str  # the line that tells the user what happened
    seconds: float | None  # from the fault to the last other rank's exit; from the start where no fault is marked
    hung: bool
    result: dict = field(default_factory=dict)
    workdir: Path | None = None
    log: str = ""


_ERROR_LINE = re.compile(r"^((?:rank \d+: )?\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Terminated)\b:?.*)$")


def what_the_user_sees(log: str) -> str:
    """Our diagnosis ("rank N: ...") where there is one, else the last exception line."""
    lines = [re.sub(r"^\[rank(\d+)\]:\s?", r"rank \1: ", ln) for ln in log.splitlines()]
    lines = [re.sub(r"^(rank \d+: )(rank \d+: )", r"\2", ln) for ln in lines]
    ours = [ln for ln in lines if re.search(r"\brank \d+: .* failed (because|and the rendezvous)", ln)]
    errors = ours or [m.group(1) for ln in lines if (m := _ERROR_LINE.match(ln))]
    if not errors:
        return ""
    seen = errors[-1].strip()
    seen = re.sub(r"\s*Original error: .*", "", seen)
    return seen if len(seen) <= 200 else seen[:197] + "..."


def run(spec: dict, kill_rank_0_at_fault: bool = False) -> Run:
    d = Path(tempfile.mkdtemp(prefix="fault-"))
    spec = {**spec, "out": str(d)}
    log_path = d / "log"
    started = time.time()
    proc = harness.spawn([sys.executable, str(WORKER), "--spec", json.dumps(spec)], log_path)
    fault_at: float | None = None
    faulted_rank = (spec.get("fault") or {}).get("rank")
    hung = False
    try:
        while True:
            if fault_at is None and (d / "fault").exists():
                text = (d / "fault").read_text().split()
                if text:
                    fault_at = float(text[0])
                    if kill_rank_0_at_fault:
                        faulted_rank = 0
                        kill_quietly(pid_files(d)[0])
            others = [pid for r, pid in pid_files(d).items() if r != faulted_rank]
            if proc.poll() is not None and not any(alive(p) for p in others):
                break
            if time.time() - (fault_at or started) > CAP_S + (0 if fault_at else 240):
                hung = True
                break
            time.sleep(0.05)
        ended = time.time()
    finally:
        end_run(proc, d)
    log = log_path.read_text(errors="replace")
    result = json.loads((d / "result.json").read_text()) if (d / "result.json").exists() else {}
    seconds = ended - (fault_at or started)
    return Run(proc.returncode, what_the_user_sees(log), seconds, hung, result, d, log)


# ---------------------------------------------------------------------------------------------- the faults


@dataclass
class Fault:
    name: str
    what: str
    ours: dict | None
    ddp: dict | None
    describe: Callable[[Run, str], str] | None = None  # (run, contender) -> outcome; default: exit + line
    kill_rank_0_at_fault: bool = False
    needs_mount: bool = False
    prepare: Callable[[dict, Path], dict] | None = None  # (spec, scratch) -> spec, before the run
    repeat: int = 1  # runs per contender; the row shows the median run and every run's seconds


def _crash_outcome(r: Run, contender: str) -> str:
    if r.hung:
        return f"**hangs**: ranks still alive {CAP_S} s after the fault (killed by this script)"
    seen = r.seen or "(no error line)"
    return f"exit {r.returncode} after **{r.seconds:.1f} s**: `{seen}`"


def _nan_outcome(r: Run, contender: str) -> str:
    if not r.result:
        return _crash_outcome(r, contender)
    s = r.result["param_sum"]
    return f"finishes {r.result['global_step']} steps; parameters {'finite' if math.isfinite(s) else '**NaN**'}"


def _trains_outcome(r: Run, contender: str) -> str:
    if r.result:
        extra = f", stage {r.result['zero_stage']}" if r.result.get("zero_stage") is not None else ""
        return f"trains ({r.seconds:.0f} s){extra}; parameter sum {r.result['param_sum']:.4f}"
    if r.hung:
        return "**hangs**"
    return f"error after {r.seconds:.0f} s: `{r.seen or '(no error line)'}`"


def _base(**flags) -> dict:
    return {"devices": 4, "steps": 12, "flags": {"timeout": TIMEOUT_S, **flags}}


OURS_2x2 = {"devices_per_node": 2}


def faults() -> list[Fault]:
    stop1 = {"fault": {"kind": "sigstop", "rank": 1, "step": 5}}
    stop2 = {"fault": {"kind": "sigstop", "rank": 2, "step": 5}}
    return [
        Fault("sigstop, one node", "`kill -STOP` of rank 1 (one node of 4 ranks)",
              {**_base(), **stop1}, {**_base(), **stop1}, _crash_outcome),
        Fault("sigstop, two nodes", "`kill -STOP` of rank 2 (2 nodes x 2)",
              {**_base(**OURS_2x2), **stop2}, {**_base(), **stop2}, _crash_outcome),
        Fault("sigkill", "`kill -9` of rank 2",
              {**_base(**OURS_2x2), "fault": {"kind": "sigkill", "rank": 2, "step": 5}},
              {**_base(), "fault": {"kind": "sigkill", "rank": 2, "step": 5}}, _crash_outcome, repeat=3),
        Fault("raise", "an exception in rank 2's `training_step`",
              {**_base(**OURS_2x2), "fault": {"kind": "raise", "rank": 2, "step": 5}},
              {**_base(), "fault": {"kind": "raise", "rank": 2, "step": 5}}, _crash_outcome, repeat=3),
        Fault("nan", "a NaN loss on rank 1 at step 5 (ours: `skip_nonfinite=True`)",
              {**_base(**OURS_2x2, skip_nonfinite=True), "fault": {"kind": "nan", "rank": 1, "step": 5}},
              {**_base(), "fault": {"kind": "nan", "rank": 1, "step": 5}}, _nan_outcome),
        Fault("kill rank 0 mid-save", "`kill -9` of rank 0 in the middle of its second checkpoint write (ours: stage 2)",
              {**_base(**OURS_2x2, zero_stage=2), "save_every": 3, "stall_save": True},
              {**_base(), "save_every": 3, "stall_save": True}, _with_checkpoint(_crash_outcome),
              kill_rank_0_at_fault=True, prepare=_ckpt_in_scratch, repeat=3),
        Fault("full disk", "the checkpoint's filesystem fills up on the second save (ours: stage 2)",
              {**_base(**OURS_2x2, zero_stage=2), "save_every": 3, "width": 256},
              {**_base(), "save_every": 3, "width": 256}, _with_checkpoint(_crash_outcome),
              needs_mount=True, prepare=_small_disk),
        Fault("read-only directory", "the checkpoint directory is read-only (ours: stage 2)",
              {**_base(**OURS_2x2, zero_stage=2), "save_every": 3},
              {**_base(), "save_every": 3}, _crash_outcome, needs_mount=True, prepare=_read_only_dir),
        Fault("random bytes checkpoint", "`fit(ckpt_path=...)` of a file of 4 kB of random bytes",
              {**_base(), "devices": 2}, {**_base(), "devices": 2}, _crash_outcome,
              prepare=lambda s, d: _corrupt(s, d, os.urandom(4096))),
        Fault("empty checkpoint", "`fit(ckpt_path=...)` of an empty file",
              {**_base(), "devices": 2}, {**_base(), "devices": 2}, _crash_outcome,
              prepare=lambda s, d: _corrupt(s, d, b"")),
        Fault("save after fit", "`trainer.save_checkpoint` after `fit` (ours: stage 2), resumed on 2 ranks (ours: stage 0)",
              {**_base(**OURS_2x2, zero_stage=2), "save_after_fit": True},
              {**_base(), "save_after_fit": True}, _resume_outcome, prepare=_ckpt_in_scratch),
        Fault("sharded checkpoint", "`checkpoint=\"sharded\"` at stage 2, resumed on 2 ranks at stage 1",
              {**_base(**OURS_2x2, zero_stage=2, checkpoint="sharded"), "save_after_fit": True},
              None, _resume_outcome, prepare=_ckpt_in_scratch),
        Fault("optimizer subclass", "a LARS-like optimizer (per-tensor trust ratio) subclassing `SGD` (ours: stage 2)",
              {**_base(**OURS_2x2, zero_stage=2), "optimizer": "lars"}, {**_base(), "optimizer": "lars"},
              _trains_outcome),
        Fault("config precedence", "`config=` a stage-2 DeepSpeed config plus `zero_stage=0`",
              {**_base(**OURS_2x2, zero_stage=0, config={"zero_optimization": {"stage": 2}})}, None, _trains_outcome),
        Fault("bucket_size_mb=inf", "`bucket_size_mb=inf` (ddp: `bucket_cap_mb=inf`)",
              {**_base(bucket_size_mb=math.inf)}, {**_base(bucket_cap_mb=math.inf)}, _trains_outcome),
        Fault("timeout=nan", "`timeout=nan` (seconds)",
              {**_base(), "flags": {"timeout": math.nan}}, {**_base(), "flags": {"timeout": math.nan}},
              _trains_outcome),
        Fault("broadcast_buffers=\"no\"", "`broadcast_buffers=\"no\"`",
              {**_base(broadcast_buffers="no")}, {**_base(broadcast_buffers="no")}, _trains_outcome),
        *mesh_faults(),
        Fault("stage 3, blocks in a ModuleList", "GPT-2's layout (blocks in an `nn.ModuleList`, smaller than a unit),"
              " stage 3 with the default `auto_wrap_policy`",
              {**_base(**OURS_2x2, zero_stage=3), "model": "blocks"}, {**_base(), "model": "blocks"}, _trains_outcome),
    ]


MESH = {"TP 2 x DP 2": {"devices_per_node": 2, "tensor_parallel_size": 2},
        "P 2 x D 2": {"devices_per_node": 2, "pipeline_parallel_size": 2},
        "P 2 x T 2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}}


def mesh_faults() -> list[Fault]:
    """The 3-D mesh's rows (names start with "mesh"): the tied GPT of ``ddp_plugin.testing.gpt``, a rank in each
    position killed, stopped or raising at step 5 (a tensor-parallel peer, the first and the last pipeline stage),
    and a kill in the middle of a sharded save with tensor parallelism and with pipeline stages. Lightning's
    ``ddp`` has no tensor or pipeline parallelism: its column is the same fault in the same GPT trained data
    parallel over the 4 ranks, the time the issue's bounds are stated against (a kill or a raise: ``ddp``'s time
    + 0.5 s; a stop: the timeout + 5 s). The kills mid-save have none (``ddp`` writes no sharded checkpoint)."""
    rows = []
    for layout, kind, rank, where in [
        ("TP 2 x DP 2", "sigkill", 1, "a tensor-parallel peer of rank 0"),
        ("TP 2 x DP 2", "sigstop", 3, "the second data-parallel rank's tensor-parallel peer"),
        ("TP 2 x DP 2", "raise", 2, "the second data-parallel rank"),
        ("P 2 x D 2", "sigkill", 0, "the first stage's, which hosts the store"),
        ("P 2 x D 2", "sigstop", 1, "the first stage's second data-parallel rank"),
        ("P 2 x D 2", "raise", 3, "the last stage's"),
        ("P 2 x T 2", "sigkill", 2, "the last stage's first tensor-parallel rank"),
        ("P 2 x T 2", "sigstop", 1, "the first stage's second tensor-parallel rank"),
        ("P 2 x T 2", "raise", 3, "the last stage's second tensor-parallel rank"),
    ]:
        verb = {"sigkill": "`kill -9`", "sigstop": "`kill -STOP`", "raise": "an exception in `training_step`"}[kind]
        fault = {"model": "gpt", "fault": {"kind": kind, "rank": rank, "step": 5}}
        rows.append(Fault(f"mesh {layout} {kind} {rank}", f"{layout}, the tied GPT: {verb} of rank {rank} ({where};"
                          " `ddp`: data parallel)", {**_base(**MESH[layout]), **fault}, {**_base(), **fault},
                          # (a kill or a raise: a second or two, where Lightning's launcher, which checks its
                          # children every 5 s, may end the run first; the median of 3 runs)
                          _crash_outcome, repeat=1 if kind == "sigstop" else 3))
    for layout, rank in [("TP 2 x DP 2", 1), ("P 2 x D 2", 3)]:
        rows.append(Fault(
            f"mesh {layout} kill mid-save", f"{layout}, the tied GPT, `checkpoint=\"sharded\"` saved after steps 3 and"
            f" 6: `kill -9` of rank {rank} as the second save starts writing its part",
            {**_base(**MESH[layout], checkpoint="sharded"), "model": "gpt", "save_every": 3,
             "fault": {"kind": "sigkill_in_save", "rank": rank, "step": 6}}, None,
            _with_checkpoint(_crash_outcome), prepare=_ckpt_in_scratch))
    return rows


def _ckpt_in_scratch(spec: dict, scratch: Path) -> dict:
    return {**spec, "ckpt": str(scratch / "model.ckpt")}


def _corrupt(spec: dict, scratch: Path, data: bytes) -> dict:
    path = scratch / "bad.ckpt"
    path.write_bytes(data)
    return {**spec, "resume": str(path)}


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, capture_output=True)


def _small_disk(spec: dict, scratch: Path) -> dict:
    # Room for one checkpoint (about 0.8 MB) but not for the second beside it: an atomic write needs both.
    _mount_tmpfs(scratch / "disk", "1200k")
    return {**spec, "ckpt": str(scratch / "disk" / "model.ckpt")}


def _read_only_dir(spec: dict, scratch: Path) -> dict:
    _mount_tmpfs(scratch / "ro", "1m")
    subprocess.run(["mount", "-o", "remount,ro", str(scratch / "ro")], check=True, capture_output=True)
    return {**spec, "ckpt": str(scratch / "ro" / "model.ckpt")}


def _with_checkpoint(outcome: Callable[[Run, str], str]) -> Callable[[Run, str], str]:
    """The outcome, and what the checkpoint file holds afterwards."""

    def describe(r: Run, contender: str) -> str:
        ckpt = Path(r.spec_ckpt) if getattr(r, "spec_ckpt", None) else None
        text = outcome(r, contender)
        if ckpt is None:
            return text
        if not ckpt.exists():
            return f"{text}; no checkpoint file"
        try:
            if ckpt.is_dir():  # (a sharded checkpoint: a directory of DCP files)
                from ddp_plugin.checkpoints.sharded_checkpoint import load

                loaded = load(ckpt)
                step = f"{loaded['global_step']}, {len(loaded['state_dict'])} tensors"
            else:
                import torch

                step = torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"]
            return f"{text}; the checkpoint loads (step {step})"
        except Exception as err:  # noqa: BLE001
            return f"{text}; **the checkpoint does not load** ({type(err).__name__})"

    return describe


def _resume_outcome(r: Run, contender: str) -> str:
    if not r.result:
        return f"save fails: {_crash_outcome(r, contender)}"
    resumed = getattr(r, "resumed", None)
    if resumed is None:
        return "saved"
    if resumed.result:
        return f"saves; resumes to step {resumed.result['global_step']}"
    return f"saves; **resume fails**: `{resumed.seen or '(no error line)'}`"


def _resume_spec(spec: dict, contender: str) -> dict:
    flags = {"timeout": TIMEOUT_S}
    if contender == "ours":
        sharded = spec["flags"].get("checkpoint") == "sharded"
        flags.update(zero_stage=1 if sharded else 0)
    return {"devices": 2, "steps": spec["steps"] + 2, "flags": flags, "resume": spec["ckpt"]}


def _can_mount() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root to mount a small tmpfs"
    probe = Path(tempfile.mkdtemp(prefix="fault-mount-"))
    try:
        _mount_tmpfs(probe, "64k")
        subprocess.run(["umount", str(probe)], check=True, capture_output=True)
        return True, ""
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        return False, f"cannot mount a tmpfs here ({err})"
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def run_fault(fault: Fault, contender: str, spec: dict) -> Run:
    scratch = Path(tempfile.mkdtemp(prefix="fault-scratch-"))
    spec = {**spec, "strategy": contender}
    try:
        if fault.prepare is not None:
            spec = fault.prepare(spec, scratch)
        r = run(spec, kill_rank_0_at_fault=fault.kill_rank_0_at_fault)
        r.spec_ckpt = spec.get("ckpt")  # type: ignore[attr-defined]
        if fault.describe is _resume_outcome and r.result:
            r.resumed = run({**_resume_spec(spec, contender), "strategy": contender})  # type: ignore[attr-defined]
        r.outcome = (fault.describe or _crash_outcome)(r, contender)  # type: ignore[attr-defined]
        return r
    finally:
        for m in ("disk", "ro"):
            if (scratch / m).is_mount():
                subprocess.run(["umount", "-l", str(scratch / m)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = harness.parser(__doc__)
    p.add_argument("--only", default="", help="comma-separated words; run the faults whose names contain one")
    harness.add_common(p, out=harness.RESULTS / "faults.md", keep=True)
    args = p.parse_args(argv)
    bench = harness.Run(__file__, argv, quiet=args.quiet, ranks=4)
    words = harness.split(args.only)
    mount_ok, mount_reason = _can_mount()
    rows = []
    for fault in faults():
        if words and not any(w in fault.name for w in words):
            continue
        cells = []
        for contender, spec in (("ours", fault.ours), ("ddp", fault.ddp)):
            if spec is None:
                cells.append("(no counterpart)")
                continue
            if fault.needs_mount and not mount_ok:
                cells.append(f"skipped: {mount_reason}")
                continue
            runs = []
            for _ in range(fault.repeat):
                r = run_fault(fault, contender, spec)
                runs.append(r)
                print(f"[{bench.wall_s:6.0f} s] {fault.name} / {contender}: {r.outcome}", flush=True)
                if args.keep:
                    print(f"    {r.workdir}")
                else:
                    shutil.rmtree(r.workdir, ignore_errors=True)
            seconds = [r.seconds for r in runs]
            if len(runs) > 1 and None not in seconds:
                median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
                cells.append(f"{median.outcome} ({len(runs)} runs: {', '.join(f'{t:.1f}' for t in seconds)} s)")
            else:
                cells.append(runs[0].outcome)  # type: ignore[attr-defined]
        rows.append([fault.what, *cells])
    text = "\n".join([
        "# Fault matrix",
        "",
        *bench.header(),
        "- setup: 4 CPU ranks over gloo under Lightning's launcher (ours as 2 simulated nodes x 2 unless the row says"
        " one node), a small MLP with AdamW (the mesh's rows: the tied GPT of `ddp_plugin.testing.gpt`),"
        f" `timeout={TIMEOUT_S}` s for both. Times are from the fault until the last other rank exited (where a fault"
        " is injected), else the run's wall time; rows with several runs show the median run",
        "",
        *harness.table(["fault", "ddp_plugin (`hierarchical_zero`)", "Lightning `ddp`"], rows, "lll"),
        "",
    ])
    harness.write(args.out, text)


if __name__ == "__main__":
    main()
