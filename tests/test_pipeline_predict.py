"""``trainer.predict`` with pipeline stages: ``predict_step`` written as under ``ddp`` (``return self.model(x)``)
runs a forward-only schedule over the microbatches, and every stage returns the last stage's output for its batch.
Predicted after a fit (P 2 x D 2) and from that checkpoint into models built on meta on other layouts (P 2 x T 2,
interleaved, GPipe over 4 stages), with short last batches (padded, the padding dropped): each prediction equals
the checkpoint's model run whole, and every sample is predicted once per data-parallel position. Before, the
split model's ``forward`` ran on each rank with the other stages' modules missing and failed."""

from __future__ import annotations

import json

import pytest

from tests.support import WORKERS, run_python
from tests.workers.predict_run import LAYOUTS, SIZE
from ddp_plugin.testing.gpt import token_dataset

SAMPLES = 13


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "result.jsonl"
    run_python(WORKERS / "predict_run.py", "--out", out, timeout=600)
    return {r["case"]: r["ranks"] for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_predictions_equal_the_whole_model_on_every_rank(runs, case):
    for rank, r in enumerate(runs[case]):
        assert r["error"] < 1e-5, (rank, r["error"])
        assert r["shapes"] == [[b, SIZE["seq"], SIZE["vocab"]] for b in r["batches"]], (rank, r)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_every_sample_is_predicted_once_per_data_parallel_position(runs, case):
    layout = LAYOUTS[case]
    p, t = layout.get("pipeline_parallel_size", 1), layout.get("tensor_parallel_size", 1)
    data_parallel = 4 // (p * t)
    x, _ = token_dataset(SAMPLES, seq=SIZE["seq"], vocab=SIZE["vocab"], seed=1).tensors
    ranks = runs[case]
    # Ranks are laid out (pipeline, data, tensor): the first data-parallel position's ranks, then the next.
    first_stage = [ranks[d * t] for d in range(data_parallel)]
    assert sum(sum(r["batches"]) for r in first_stage) == SAMPLES, [r["batches"] for r in first_stage]
    assert {tuple(row) for r in first_stage for row in r["rows"]} == {tuple(row) for row in x.tolist()}
    for r in ranks:  # every stage and tensor-parallel rank of a position returns that position's predictions
        assert any(r["rows"] == s["rows"] and r["batches"] == s["batches"] for s in first_stage), r["batches"]
