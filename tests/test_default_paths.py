"""Every codec with every other flag at its default, on the layouts users have: a default path that crashes must
not land again (PowerSGD on 2 nodes x 2 with the default ``hierarchical`` crashed in the link probe, and no test
ran it).

One launch of 4 CPU ranks (tests/workers/defaults_run.py) trains the tiny tied GPT for 12 steps under each case
in turn: the built-in codecs, the example entry-point codec (examples/onebit_codec, installed as a real
distribution), no codec and ``"auto"``, on one node of 4, 2 simulated nodes x 2 (the route left to the link
probe), the same with ZeRO stages 1-3 and with DiLoCo (``sync_every=4``: the codec codes the pseudo-gradients), and
tensor or pipeline parallelism of 2 with data parallelism of 2 across the nodes; none of them is refused at
construction. (With tensor or pipeline parallelism of 2 on 4 ranks a node
holds one data-parallel rank, so there is no route to choose; that would take 8 ranks, not run here.)
"""

from __future__ import annotations

import json

import pytest

from tests.support import WORKERS, run_python
from tests.workers.defaults_run import CASES, CODECS

STEPS = 12  # PowerSGD averages exactly for its first 10 steps (start_iter): 2 compressed steps after them


@pytest.fixture(scope="module")
def results(onebit_install, tmp_path_factory):
    out = tmp_path_factory.mktemp("defaults") / "result.jsonl"
    proc = run_python(WORKERS / "defaults_run.py", "--out", out, "--steps", str(STEPS), timeout=900,
                      pythonpath=[onebit_install], check=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return {r["case"]: r for r in lines}, proc


@pytest.mark.parametrize("case", CASES)
def test_the_default_path_trains(results, case):
    done, proc = results
    if case not in done:
        crashed = next((c for c in CASES if c not in done), None)
        pytest.fail(f"{case}: no result; the launch ended at {crashed} (exit code {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    run = done[case]
    assert "refused" not in run, run["refused"]
    assert run["steps"] == STEPS and len(run["losses"]) == STEPS and run["finite"], run
    assert run["replicas_identical"], run
    assert run["losses"][-1] < run["losses"][0], run["losses"]  # it learned


def test_every_layout_with_several_nodes_of_several_ranks_lets_the_probe_choose_the_route(results):
    done, _ = results
    for case, run in done.items():
        layout, codec = case.split("/")
        if layout.startswith("2x2") and "refused" not in run:
            assert run["plan"] is not None, case  # the link probe ran: the path that crashed for PowerSGD


def test_the_matrix_covers_every_builtin_codec():
    from ddp_plugin.codecs import BUILTIN_CODECS

    assert set(BUILTIN_CODECS) <= set(CODECS)
