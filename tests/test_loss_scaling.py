"""fp16 with a loss scaler (Lightning's ``16-mixed``; on a GPU its scaler is CUDA's, here torch's CPU one): the
strategy's clipping sees the unscaled gradients, a step with a non-finite gradient is skipped on every rank and
backs the scale off everywhere (ZeRO shards and ``skip_nonfinite`` included), and the pipeline schedule's
backward scales the loss as the scaler would. Lightning's ``ddp`` under the same scaler is the reference.

The cases run in one launch of 2 CPU ranks (tests/workers/loss_scaling_run.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import WORKERS, run_python
from tests.workers.loss_scaling_run import INF_STEP

STEPS = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling") / "result.jsonl"
    run_python(WORKERS / "loss_scaling_run.py", "--out", out, "--steps", str(STEPS), timeout=600)
    return {r["case"]: r["ranks"] for r in map(json.loads, out.read_text().splitlines())}


def params(ranks: list[dict], rank: int = 0) -> torch.Tensor:
    return torch.tensor(ranks[rank]["params"])


@pytest.mark.parametrize("case", ["ours:0:flag", "ours:2:flag", "ours:2:trainer"])
def test_clipping_under_a_loss_scaler_clips_the_unscaled_gradients_as_ddp_does(runs, case):
    reference = params(runs["ddp"])
    assert (params(runs["ddp"]) - torch.tensor(runs["ddp"][1]["params"])).abs().max() == 0
    for rank in range(2):
        torch.testing.assert_close(params(runs[case], rank), reference, atol=1e-6, rtol=0)
    # (the clipping binds: the reference moved, and unclipped SGD would have moved it further)
    assert runs["ddp"][0]["scales"] == [1024.0] * STEPS


@pytest.mark.parametrize("case", ["ours:0:inf", "ours:2:inf", "ours:2:inf:skip", "ours:0:inf:skip"])
def test_a_non_finite_gradient_skips_the_step_and_backs_the_scale_off_on_every_rank(runs, case):
    reference = runs["ddp:inf"][0]
    expected = [1024.0] * INF_STEP + [512.0] * (STEPS - INF_STEP)
    assert reference["scales"] == expected  # (Lightning's ddp: the scaler skipped step 3 and halved its scale)
    for rank, r in enumerate(runs[case]):
        assert r["scales"] == expected, (rank, r["scales"])
        torch.testing.assert_close(params(runs[case], rank), params(runs["ddp:inf"]), atol=1e-6, rtol=0)
        if case.endswith(":skip"):
            assert r["skipped"] == 1, (rank, r["skipped"])


def test_the_pipeline_schedule_scales_the_loss_as_the_scaler_does(runs):
    # The same run under a scale of 1024 and of 1: the scaler's unscale_ must find gradients scaled by its scale.
    for rank in range(2):
        scaled, unscaled = params(runs["pp:1024"], rank), params(runs["pp:1"], rank)
        assert runs["pp:1024"][rank]["scales"] == [1024.0] * STEPS
        # (fp16 rounds small gradients to zero at a scale of 1: 3e-4 apart; unscaled twice, 0.15 apart)
        torch.testing.assert_close(scaled, unscaled, atol=2e-3, rtol=0)
