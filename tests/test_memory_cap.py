"""A model whose whole fp32 weights are larger than the memory each rank process may use trains, checkpoints,
resumes and predicts at P 2 x T 2 on 4 CPU ranks, and a consolidated save, which would gather the whole model
on rank 0, is refused before anything is written (tests/workers/capped_run.py): each rank runs in a memory cgroup
of its own, capped below the whole model's size, so a rank that ever holds the whole model (or most of it) is
ended by the kernel. The model is built on the meta device and materialized part by part; the sharded
checkpoint is read lazily, each rank reading only the blocks it holds, and copied tensor by tensor. Before, the
resume read every tensor of the checkpoint on every rank (2.5x the whole model's size) and was killed.

Needs a memory cgroup this process may create children in (root, or a delegated cgroup); skipped otherwise."""

from __future__ import annotations

import json
import os

import pytest

from ddp_plugin.testing import cgroup
from tests.support import WORKERS, run_python

# 12 x 1280^2 x 13 blocks: 975 MiB of fp32 weights, a rank's quarter 244 MiB (plus as much for its gradients).
SIZE = ["--d-model", "1280", "--layers", "13"]
CAP_MB = 900
PHASES = ("fit", "resume", "predict", "master")

reason = cgroup.unavailable()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"no per-process memory cap here: {reason}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("capped")
    name = f"test{os.getpid()}"
    phases = {}
    try:
        for phase in PHASES:
            result = out / f"{phase}.json"
            run_python(WORKERS / "capped_run.py", "--phase", phase, "--out", result, "--cap-mb", str(CAP_MB),
                       "--name", f"{name}{phase}", *SIZE, timeout=900)
            phases[phase] = json.loads(result.read_text())
    finally:
        cgroup.remove([f"{name}{phase}_{rank}" for phase in PHASES for rank in range(4)])
    return phases


def test_the_whole_model_is_larger_than_what_a_rank_may_use(runs):
    for phase, ranks in runs.items():
        for r in ranks:
            assert r["whole_bytes"] > r["cap"] == CAP_MB << 20, (phase, r)
            assert r["held_bytes"] < r["whole_bytes"] / 3, (phase, r)  # a quarter, the replicated biases aside
            assert r["oom_kills"] == 0 and r["peak"] <= r["cap"], (phase, r)


def test_it_trains_checkpoints_resumes_from_the_saved_values_and_predicts(runs):
    assert [r["steps"] for r in runs["fit"]] == [2] * 4
    assert [r["steps"] for r in runs["resume"]] == [3] * 4
    assert [r["start"] for r in runs["resume"]] == [r["saved"] for r in runs["fit"]]  # each rank's part, exactly
    for r in runs["predict"]:
        assert r["predicted"] == [4, 8, 32] and r["finite"], r


def test_a_master_checkpoint_that_would_not_fit_rank_0_is_refused_before_anything_is_written(runs):
    # checkpoint="master" gathers the whole model on global rank 0: refused on every rank, naming the way out.
    for r in runs["master"]:
        assert r["refused"] is not None and "checkpoint='sharded'" in r["refused"], r["refused"]
        assert "0.95 GiB of parameters and optimizer state" in r["refused"], r["refused"]
        assert not r["written"]
