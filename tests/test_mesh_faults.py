"""Faults in the 3-D mesh: a rank killed, stopped or raising meets the others inside the mesh's own collectives
(tensor-parallel forward and backward, the pipeline's sends and receives), not in the gradient sync. The survivors
name it and the phase, as the gradient sync's diagnosis does, and no teardown error follows the cause
(moving DTensor parameters to the CPU after a failed collective raised "Couldn't swap Linear.weight").

4 CPU ranks under Lightning's launcher (tests/workers/mesh_fault_run.py), the tiny tied GPT, the fault at the start
of step 5 on one rank.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from ddp_plugin.testing.processes import alive, clean_env, end_run, pid_files, stopped
from tests.support import ROOT, WORKERS, interpreter

TIMEOUT_S = 8
STARTUP_S = 600  # a busy machine may take minutes to start 4 ranks; only what follows the fault is timed

LAYOUTS = {
    "tp2_dp2": {"devices_per_node": 2, "tensor_parallel_size": 2},
    "pp2_dp2": {"devices_per_node": 2, "pipeline_parallel_size": 2},
    "pp2_tp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
}


def run_fault(tmp_path: Path, mode: str, rank: int, flags: dict,
              timeout: float = TIMEOUT_S) -> tuple[dict[int, str], dict[int, float], str]:
    """Run the worker until the faulty rank has faulted and every other rank's process has ended (at most the
    timeout plus a minute after the fault). Returns each survivor's exit line, how many seconds after the fault
    each was gone, and the output."""
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [interpreter(), str(WORKERS / "mesh_fault_run.py"), "--mode", mode, "--rank", str(rank), "--flags",
             json.dumps(flags), "--timeout", str(timeout), "--out", str(tmp_path)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=clean_env(),
        )
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + STARTUP_S
        mark = {"die": r"rank \d kills itself \(SIGKILL\) at ([\d.]+)", "raise": r"rank \d raises at ([\d.]+)",
                "stop": None, "save": r"rank \d kills itself \(SIGKILL\) at ([\d.]+)"}[mode]
        fault_at = None
        while fault_at is None:
            assert time.monotonic() < deadline, "training never reached the fault"
            if mode == "stop":
                if (tmp_path / "stopped").exists():
                    time.sleep(0.2)
                    fault_at = float((tmp_path / "stopped").read_text().split()[1])
            elif found := re.search(mark, log.read_text()):
                fault_at = float(found.group(1))
            if fault_at is None:
                assert proc.poll() is None, log.read_text()[-4000:]
                time.sleep(0.1)
        pids = pid_files(tmp_path)
        others = {r: pid for r, pid in pids.items() if r != rank}
        gone_after: dict[int, float] = {}
        while time.time() - fault_at < timeout + 60 and len(gone_after) < len(others):
            for r, pid in others.items():
                if r not in gone_after and (not alive(pid) or stopped(pid)):
                    gone_after[r] = time.time() - fault_at
            proc.poll()
            time.sleep(0.1)
        if mode != "stop":
            proc.wait(timeout=60)
        out = log.read_text()
        lines = {int(r): line for r, line in re.findall(r"rank (\d) exits after \S+ s \(at [\d.]+\): (.*)", out)}
        return lines, gone_after, out
    finally:
        end_run(proc, tmp_path, also=set(pids.values()), timeout=60)


@pytest.mark.parametrize(("layout", "mode", "rank"), [
    ("tp2_dp2", "die", 1),  # a tensor-parallel peer of rank 0
    ("tp2_dp2", "stop", 3),
    ("tp2_dp2", "raise", 2),
    ("pp2_dp2", "die", 0),  # the first stage's (and the store's) rank
    ("pp2_dp2", "raise", 3),  # the last stage
    ("pp2_tp2", "die", 2),  # the last stage's first tensor-parallel rank
    ("pp2_tp2", "stop", 1),  # the first stage
])
def test_a_fault_inside_the_mesh_is_named_by_every_survivor_and_teardown_adds_nothing(tmp_path, layout, mode, rank):
    lines, gone_after, out = run_fault(tmp_path, mode, rank, LAYOUTS[layout])
    survivors = {0, 1, 2, 3} - {rank}
    assert set(gone_after) == survivors, f"still running a minute past the timeout:\n{out[-4000:]}"
    assert "Couldn't swap" not in out and "teardown after" not in out.split("Traceback")[0], out[-4000:]
    cause = (f"rank {rank} failed with ValueError: the user's training_step broke on purpose" if mode == "raise"
             else f"rank {rank} stopped responding (killed, crashed or hung)")
    named = [r for r in survivors if r in lines and cause in lines[r]]
    # Every survivor that raised names the rank; one killed by the launcher first (it stops every rank once a
    # child has died) may print nothing.
    assert named, out[-6000:]
    # Nobody else is blamed. (The store's host, rank 0, waits at exit until every survivor has read the cause
    # from it: one whose diagnosis came after rank 0 had exited named rank 0 instead of a raising rank.)
    for r, line in lines.items():
        if r in survivors:
            assert cause in line or "failed because" not in line, line
    phases = set(re.findall(r"rank \d: (the .*?) failed because", out))
    assert phases and all(p.startswith(("the tensor-parallel forward of", "the tensor-parallel backward of",
                                        "the pipeline schedule of stage", "gradient synchronization"))
                          for p in phases), phases
    # Within the fault matrix's bounds: at once for a kill or a raise; the timeout and the watch for a stop.
    bound = TIMEOUT_S + 8 if mode == "stop" else 10
    assert max(gone_after.values()) < bound + 30, gone_after  # (+ exit: CPU work on a busy 2-core machine)


def test_a_kill_in_the_tensor_parallel_mesh_ends_every_survivor_long_before_the_collective_timeout(tmp_path):
    # TP 2 x DP 2, rank 1 killed: rank 2's reduction of a replicated bucket fails (its data-parallel peer, rank 0,
    # is gone), so it never broadcasts the bucket to rank 3, its tensor-parallel peer, which waited for that
    # broadcast until the collective timeout (21.8 s at timeout=20 in the fault matrix), and rank 2's teardown
    # waited as long for its communication thread. With a timeout of two minutes, every survivor is gone within
    # the first one (seconds on an idle machine).
    timeout = 120
    lines, gone_after, out = run_fault(tmp_path, "die", 1, LAYOUTS["tp2_dp2"], timeout=timeout)
    assert set(gone_after) == {0, 2, 3}, out[-4000:]
    assert max(gone_after.values()) < timeout / 2, (gone_after, out[-6000:])
    assert [r for r in (0, 2, 3) if "rank 1 stopped responding" in lines.get(r, "")], out[-6000:]


@pytest.mark.parametrize(("layout", "rank"), [("tp2_dp2", 1), ("pp2_dp2", 3)])
def test_a_kill_during_a_sharded_save_in_the_mesh_is_named_and_the_previous_checkpoint_loads(tmp_path, layout, rank):
    from ddp_plugin.checkpoints.sharded_checkpoint import load

    lines, gone_after, out = run_fault(tmp_path, "save", rank, {**LAYOUTS[layout], "checkpoint": "sharded"})
    survivors = {0, 1, 2, 3} - {rank}
    assert set(gone_after) == survivors, f"still running a minute past the timeout:\n{out[-4000:]}"
    assert "Couldn't swap" not in out, out[-4000:]
    cause = f"rank {rank} stopped responding (killed, crashed or hung)"
    assert [r for r in survivors if r in lines and cause in lines[r]], out[-6000:]
    assert max(gone_after.values()) < 10 + 30, gone_after
    # The checkpoint saved after step 2 is still under its name, whole: every parameter of the unsplit model.
    ckpt = load(tmp_path / "mesh.ckpt")
    assert ckpt["global_step"] == 2
    assert {"model.tok.weight", "model.blocks.0.attn.q.weight", "model.blocks.1.mlp.fc.weight"} <= set(
        ckpt["state_dict"]), sorted(ckpt["state_dict"])[:10]
    assert ckpt["state_dict"]["model.tok.weight"].shape == (32, 32)
