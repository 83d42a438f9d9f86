"""Replica groups on torchft (``fault_tolerance=``): a lighthouse in this process, each replica group a Lightning
launch of its own (its own rendezvous) of tests/workers/ft_run.py; one group kills every one of its ranks
(SIGKILL) inside a step and is started again; the live groups go on without it, and it returns healed from a
live peer, with parameters and step counters equal to theirs."""

from __future__ import annotations

import importlib.util
import subprocess
import time

import pytest
import torch

from ddp_plugin.testing.processes import clean_env
from ddp_plugin.testing.ranks import free_port
from tests.support import ROOT, WORKERS, interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="needs torchft (pip install ddp_plugin[torchft])")

STEPS = 120
KILL_AT = 10
HOLD_AT = 40
"""The live groups wait at this step until the group started again is set up (it may start slowly)."""


def launch(out, group: int, groups: int, lighthouse: str, devices: int, *extra: str, tag: str = ""):
    env = clean_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    log = open(out / f"log{group}{tag}.txt", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [interpreter(), str(WORKERS / "ft_run.py"), "--out", str(out), "--group", str(group), "--groups",
         str(groups), "--lighthouse", lighthouse, "--devices", str(devices), "--steps", str(STEPS),
         "--step-sleep", "0.2", f"--tag={tag}", *extra],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def wait(proc, out, timeout: float) -> int:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    proc.log.close()
    if code not in (0, -9):
        pytest.fail(f"{proc.args} exited with {code}:\n" + open(proc.log.name).read()[-6000:])
    return code


@pytest.fixture(scope="module", params=[(3, 1), (2, 2)], ids=["3 groups of 1", "2 groups of 2"])
def run(request, tmp_path_factory):
    from torchft._torchft import LighthouseServer

    groups, devices = request.param
    out = tmp_path_factory.mktemp("ft")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    try:
        address = lighthouse.address()
        last = groups - 1
        gate = out / "gate"
        back_ready = out / "back"
        procs = [launch(out, g, groups, address, devices, "--gate", str(gate),
                        *(["--kill-at", str(KILL_AT), "--kill-in", "backward"] if g == last else
                          ["--hold-at", str(HOLD_AT), "--hold-until", f"{back_ready}.0"]))
                 for g in range(groups)]
        ready = [out / f"gate.{g}.{r}" for g in range(groups) for r in range(devices)]
        deadline = time.time() + 600
        while not all(path.exists() for path in ready):
            assert time.time() < deadline and all(p.poll() is None for p in procs), "a group did not start"
            time.sleep(0.1)
        gate.touch()
        assert wait(procs[last], out, 600) == -9
        killed_at = time.time()
        time.sleep(5)  # the live groups step without it for a while (however fast it would start again)
        back = launch(out, last, groups, address, devices, "--announce", str(back_ready), tag="-back")
        for proc in procs[:last]:
            assert wait(proc, out, 600) == 0
        assert wait(back, out, 600) == 0
    finally:
        lighthouse.shutdown()
    found = {g: torch.load(out / f"{g}.pt") for g in range(last)}
    found["back"] = torch.load(out / f"{last}-back.pt")
    return {"groups": groups, "killed_at": killed_at, **found}


def test_every_group_ends_at_the_same_step_with_the_same_parameters_bit_for_bit(run):
    first = run[0]["params"]
    for name in [g for g in range(run["groups"] - 1)] + ["back"]:
        assert run[name]["steps"][-1]["global_step"] == STEPS, name
        for key, value in first.items():
            assert torch.equal(run[name]["params"][key], value), (name, key)


def test_the_live_groups_went_on_without_the_lost_one_and_lost_at_most_the_step_it_died_in(run):
    for g in range(run["groups"] - 1):
        steps = run[g]["steps"]
        alone = [s for s in steps if s["global_step"] > KILL_AT + 1 and s["ft/replicas"] < run["groups"]]
        assert alone, "no step was made without the lost group"
        lost = steps[-1]["ft/steps_lost"]
        assert lost <= 2, lost
        assert steps[-1]["ft/step"] == STEPS - lost  # torchft's committed steps: the others


def test_the_returning_group_healed_from_a_live_peer_and_stepped_on_from_there(run):
    steps = run["back"]["steps"]
    assert steps[0]["global_step"] > KILL_AT + 1  # it did not start over: it took its peers' step counters
    assert steps[-1]["ft/heals"] >= 1
    assert steps[-1]["ft/replicas"] == run["groups"]  # back in the quorum, counted as a participant
