"""Every codec with every other flag at its default, on the layouts users have: a default path that crashes must
not land again (PowerSGD on 2 nodes x 2 with the default ``hierarchical`` crashed in the link probe, and no test
ran it).

One launch of 4 CPU ranks (tests/workers/defaults_run.py) trains the tiny tied GPT for 12 steps under each case
in turn. Three factors: the codec (the built-in ones, the example entry-point codec of examples/onebit_codec,
installed as a real distribution, no codec and ``"auto"``), the ZeRO stage (0-3) and the layout (one node of 4;
2 simulated nodes x 2, the route left to the link probe; the same with DiLoCo, ``sync_every=4``, where the codec
codes the pseudo-gradients; tensor or pipeline parallelism of 2 with data parallelism of 2 across the nodes).
The suite runs 46 cases in which every pair of two factors' values occurs (every codec at every stage, on every
layout, every stage on every layout), the case that found the link probe's crash among them; ``pytest
--full-matrix`` runs all 174 the strategy accepts (at stage 3 with tensor parallelism only no codec, fp16 and
bf16: the 6 others are refused at construction). (With tensor or pipeline parallelism of 2 on 4 ranks a node
holds one data-parallel rank, so there is no route to choose; that would take 8 ranks, not run here.)
"""

from __future__ import annotations

import itertools
import json

import pytest

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.pairwise import pairs_covered
from tests.support import WORKERS, matrix, run_python
from tests.workers.defaults_run import ALL_CASES, CASES, CODECS, FACTORS, GUARDS, allowed, case_flags, case_name

STEPS = 12  # PowerSGD averages exactly for its first 10 steps (start_iter): 2 compressed steps after them
RUN = matrix(CASES, ALL_CASES)


@pytest.fixture(scope="module")
def results(onebit_install, tmp_path_factory):
    out = tmp_path_factory.mktemp("defaults") / "result.jsonl"
    proc = run_python(WORKERS / "defaults_run.py", "--out", out, "--steps", str(STEPS), "--cases", ",".join(RUN),
                      timeout=900 if RUN is CASES else 3600,
                      pythonpath=[onebit_install], check=False)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return {r["case"]: r for r in lines}, proc


@pytest.mark.parametrize("case", RUN)
def test_the_default_path_trains(results, case):
    done, proc = results
    if case not in done:
        crashed = next((c for c in RUN if c not in done), None)
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


def factors_of(case: str) -> tuple:
    where, codec = case.split("/")
    return where.partition("_zero")[0], case_flags(case)["zero_stage"], codec


def test_the_cases_cover_every_pair_of_a_codec_a_stage_and_a_layout():
    every = list(itertools.product(*FACTORS.values()))
    assert sorted(map(factors_of, ALL_CASES)) == sorted(row for row in every if allowed(dict(zip(FACTORS, row))))
    assert pairs_covered(map(factors_of, CASES)) == pairs_covered(map(factors_of, ALL_CASES))
    assert len(CASES) == len(set(CASES)) <= len(FACTORS["layout"]) * len(FACTORS["codec"]) + 2  # (at least 45)
    assert {case_name(*row) for row in GUARDS} <= set(CASES)


def test_the_combinations_left_out_are_refused_at_construction(onebit_install, monkeypatch):
    monkeypatch.syspath_prepend(str(onebit_install))
    left_out = [row for row in itertools.product(*FACTORS.values()) if not allowed(dict(zip(FACTORS, row)))]
    assert left_out  # (tensor parallelism at stage 3 with a codec that codes a bucket as a whole)
    for layout, stage, codec in left_out:
        with pytest.raises(ValueError, match=f"`compression='{codec}'` with `zero_stage=3` and `tensor_parallel_size=2`"):
            HierarchicalZeroStrategy(**case_flags(case_name(layout, stage, codec)))
