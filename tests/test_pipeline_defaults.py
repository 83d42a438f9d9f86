"""Pipeline stages under Lightning's defaults (tests/workers/pp_defaults_run.py): the model summary, the progress
bar, the checkpoint callback, the logger and the sanity check on, 2 simulated nodes x 2 ranks, a stage per node.

``pipeline_split="time"`` finds the microbatch it times the blocks on by itself (the step run on the first batch
up to the model's call), so it needs no ``example_input_array``; where a module sets one (Lightning's input to its
``forward``, here a batch dict), the summary runs it through every stage, and the split is the same. The flags that
run the user's model at setup (activation checkpointing, a model built on meta, ``trainer.predict``) with the
defaults on too; a model built on meta is split by time too (its blocks timed one at a time)."""

from __future__ import annotations

import json
import math

import pytest

from tests.support import WORKERS, run_python


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[str, dict], str]:
    root = tmp_path_factory.mktemp("pp_defaults")
    out = root / "result.jsonl"
    proc = run_python(WORKERS / "pp_defaults_run.py", "--out", out, "--root", root, timeout=600)
    results = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    return results, proc.stdout


def test_the_split_by_time_needs_no_example_and_matches_the_split_with_one(runs):
    results, _ = runs
    # The heavy last block alone (by parameters, two blocks a stage: parameters-meta below), with or without
    # `example_input_array`, with int8 and bf16 activations, with activation checkpointing, and in predict.
    for case in ("time", "time-example", "time-int8", "time-checkpointing", "time-predict"):
        assert results[case]["stage_blocks"] == [[0, 1, 2], [3]], results[case]
    assert results["parameters-meta"]["stage_blocks"] == [[0, 1], [2, 3]]
    # Finding the microbatch ran the step on a shuffled batch and drew nothing from the generators: the run with
    # an example (whose summary also ran the pipeline) trained on the same batches, to the same losses.
    assert results["time"]["losses"] == results["time-example"]["losses"]


def test_a_meta_built_model_splits_by_time_and_starts_from_what_it_would_without_the_timing(runs):
    results, _ = runs
    timed, named = results["time-meta"], results["named-meta"]
    # Built on meta, timed a block at a time: the heavy last block alone, as timed on the materialized model, and
    # every rank cut the same stages.
    assert timed["stage_blocks"] == [[0, 1, 2], [3]] and timed["cuts"] == 0, timed
    assert timed["splits"] == [timed["stage_blocks"]] * 4
    # The timing's copies were initialized from a fork of the generators: every rank's parameters and generators
    # as training starts are bit for bit those of the same split named, without timing, and so are the losses.
    assert timed["initial"] == named["initial"] and all(timed["initial"]), timed["initial"]
    assert timed["losses"] == named["losses"]


@pytest.mark.parametrize("case", ["time", "time-example", "time-int8", "time-checkpointing", "parameters-meta",
                                  "time-meta"])
def test_every_default_callback_runs_with_stages(runs, case):
    results, _ = runs
    result = results[case]
    assert result["step"] == 6 and len(result["losses"]) == 6
    assert all(math.isfinite(loss) for loss in result["losses"])
    assert result["checkpoints"] == ["epoch=1-step=6.ckpt"]  # (the checkpoint callback's, at the last epoch's end)


def test_the_summary_runs_example_input_array_through_the_stages(runs):
    _, stdout = runs
    # Printed by global rank 0 (the first stage's modules): with an example, in and out sizes of the whole model's
    # call, the last stage's output brought back to the first.
    tables = [line for line in stdout.splitlines() if "│ model │ Net" in line]
    assert len(tables) == 7, stdout[-3000:]  # (every fit's summary; predict prints none)
    assert sum("[4, 8]" in line and "[4, 1]" in line for line in tables) == 4, tables


def test_predict_splits_by_time_on_its_own_data(runs):
    results, _ = runs
    assert results["time-predict"]["predictions"] == [[8, 1]]
