"""Gradients in user hooks at ZeRO stages (issue 14, item 1): what `.grad` holds in `on_after_backward`,
`on_before_optimizer_step` and `on_train_batch_end`, `strategy.full_gradients()` at stages 2-3, the strategy's
`grad_norm`, clipping by value on shards, and what it all costs across nodes. Every run is compared with Lightning's
own `ddp` trained in the same launch on the same data: 2 ranks (one node) and 4 ranks as 2 simulated nodes x 2."""

from __future__ import annotations

import pytest
import torch

from tests.support import WORKERS, run_python

ATOL = 1e-5
STEPS = 4  # optimizer steps per run (tests/workers/grads_run.py)
# (label, devices, devices_per_node, config, runs): the runs of one launch train one after the other.
ONE_NODE = ["0:global:auto", "1:global:auto", "2:global:auto", "3:global:auto"]
TWO_NODES = ["1:global:on", "1:node:on", "1:global:off", "2:global:on", "2:node:on", "3:global:on", "3:node:on"]
LAUNCHES = [
    ("2 ranks", 2, None, "norm", ["ddp", *ONE_NODE, "2:global:auto:quiet", "3:global:auto:quiet"]),
    ("2 ranks", 2, None, "value", ["ddp", "1:global:auto", "2:global:auto", "3:global:auto"]),
    ("2 nodes x 2", 4, 2, "norm", ["ddp", *TWO_NODES, "2:global:on:quiet", "3:node:on:quiet"]),
]
OBSERVED = [(label, config, run) for label, _, _, config, runs in LAUNCHES for run in runs
            if run != "ddp" and not run.endswith("quiet")]
SHARDED = [case for case in OBSERVED if case[2][0] in "23"]
QUIET = [(label, config, run.removesuffix(":quiet")) for label, _, _, config, runs in LAUNCHES for run in runs
         if run.endswith("quiet")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = {}
    for label, devices, per_node, config, runs in LAUNCHES:
        d = tmp_path_factory.mktemp("grads")
        args = ["--mode", "hooks", "--out", d, "--devices", str(devices), "--config", config, "--runs", ",".join(runs)]
        args += ["--devices-per-node", str(per_node)] if per_node else []
        run_python(WORKERS / "grads_run.py", *args, timeout=900)
        for run in runs:
            out[(label, config, run)] = torch.load(d / f"{config}-{run.replace(':', '-')}.pt")
    return out


def assert_same_grads(ours: list[dict], ddp: list[dict]) -> None:
    assert len(ours) == len(ddp) > 0
    for step, (mine, theirs) in enumerate(zip(ours, ddp)):
        assert mine.keys() == theirs.keys()
        for name in theirs:
            if theirs[name] is None:
                assert mine[name] is None, (step, name)
            else:
                assert mine[name] is not None, f"backward {step}: `{name}.grad` is None"
                torch.testing.assert_close(mine[name], theirs[name], atol=ATOL, rtol=0, msg=f"{step} {name}")


def assert_same_norms(ours: list[dict], ddp: list[dict]) -> None:
    assert len(ours) == len(ddp) == STEPS
    for mine, theirs in zip(ours, ddp):
        assert mine.keys() == theirs.keys() and "grad_2.0_norm_total" in theirs
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, abs=ATOL), key


@pytest.mark.parametrize(("launch", "config", "run"), OBSERVED)
def test_grad_norm_logged_in_on_before_optimizer_step_equals_lightning_ddps(results, launch, config, run):
    """At stages 0-1 `grad_norm(self, 2)` reads `.grad` as it is; at stages 2-3 inside `full_gradients()`."""
    assert_same_norms(results[(launch, config, run)]["grad_norm"], results[(launch, config, "ddp")]["grad_norm"])


@pytest.mark.parametrize(("launch", "config", "run"), OBSERVED)
def test_grad_read_in_on_after_backward_is_ddps_gradient(results, launch, config, run):
    """The averaged gradient after a synchronizing backward, the local one on the inner steps of accumulation."""
    assert_same_grads(results[(launch, config, run)]["after_backward"], results[(launch, config, "ddp")]["after_backward"])


@pytest.mark.parametrize(("launch", "config", "run"), OBSERVED)
def test_grad_read_in_on_train_batch_end_is_ddps_clipped_gradient(results, launch, config, run):
    """After the step: the gradient the optimizer applied, clipped by norm or by value as DDP's is."""
    assert_same_grads(results[(launch, config, run)]["batch_end"], results[(launch, config, "ddp")]["batch_end"])


@pytest.mark.parametrize(("launch", "config", "run"), OBSERVED)
def test_strategy_grad_norm_equals_lightning_grad_norm_under_ddp(results, launch, config, run):
    assert_same_norms(results[(launch, config, run)]["strategy_grad_norm"], results[(launch, config, "ddp")]["grad_norm"])


@pytest.mark.parametrize(("launch", "config", "run"), OBSERVED)
def test_training_reaches_ddps_parameters(results, launch, config, run):
    ours, ddp = results[(launch, config, run)]["params"], results[(launch, config, "ddp")]["params"]
    for name, value in ddp.items():
        torch.testing.assert_close(ours[name], value, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize(("launch", "config", "run"), QUIET)
def test_reading_gradients_through_full_gradients_does_not_change_training(results, launch, config, run):
    observed, quiet = results[(launch, config, run)]["params"], results[(launch, config, run + ":quiet")]["params"]
    for name, value in quiet.items():
        assert torch.equal(observed[name], value), name


@pytest.mark.parametrize(("launch", "config", "run"), SHARDED)
def test_gradient_memory_is_back_to_the_sharded_level_after_full_gradients(results, launch, config, run):
    trainable = sum(v.numel() * v.element_size() for k, v in results[(launch, config, run)]["params"].items()
                    if not k.startswith("frozen"))
    for before, inside, after in results[(launch, config, run)]["memory"]:
        assert after == before
        assert inside - before >= trainable  # the whole gradient lived inside, and only there


# ---------------------------------------------------------------------------------------------- traffic

TRAFFIC_RUNS = ["1:global:on", "1:node:on", "2:global:on", "2:global:on:helper", "2:node:on:helper"]


@pytest.fixture(scope="module")
def traffic(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("traffic")
    run_python(WORKERS / "grads_run.py", "--mode", "traffic", "--out", d, "--devices", "4", "--devices-per-node", "2",
               "--runs", ",".join(TRAFFIC_RUNS), timeout=600)
    return {run: torch.load(d / f"traffic-{run.replace(':', '-')}.pt") for run in TRAFFIC_RUNS}


@pytest.mark.parametrize(("run", "times_s"), [
    # Stage 1 keeps whole gradients: global shards all-reduce the node's half across nodes (S) instead of
    # reduce-scattering it (S/2), and all-gather the parameters (S/2).
    ("1:global:on", 1.5),
    # Node shards: the gradient gather stays inside the node, the slow link carries what stage 0 sends.
    ("1:node:on", 1.0),
    # Stage 2 without the helper: reduce-scatter (S/2) and parameter all-gather (S/2).
    ("2:global:on", 1.0),
    # With `full_gradients()` every step: one more all-gather of the gradient shards (S/2).
    ("2:global:on:helper", 1.5),
    # Node shards: the helper's all-gather stays inside the node.
    ("2:node:on:helper", 1.0),
])
def test_cross_node_bytes_per_node_and_step(traffic, run, times_s):
    r = traffic[run]
    s = r["gradient_bytes"]
    for step in range(1, len(r["cross_node"][0])):  # step 0 has no parameter gather of a previous step
        for node in (0, 1):
            sent = r["cross_node"][2 * node][step] + r["cross_node"][2 * node + 1][step]
            # On top of the model: the engine's bookkeeping flags (and the helper's), tens of bytes.
            assert times_s * s <= sent <= times_s * s * 1.001, (step, node, sent / s)
