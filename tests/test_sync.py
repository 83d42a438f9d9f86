"""Sync modes (``sync_every > 1``): local SGD, DiLoCo, streaming fragments, bounded staleness, against a reference
written here in one process: M replicas, each a single-process model trained on its node's concatenated batch,
synchronized across nodes as the docs define it.

Definition (docs/sync.md): with ``sync_every=H``, ``sync_fragments=F``, ``max_staleness=d``, fragment f (the
elements ``[f N // F, (f + 1) N // F)`` of the N flat parameters in bucket order) is sent after the optimizer steps t
with ``t % H == ((f + 1) * H // F) % H``: the pseudo-gradient ``x - s_n`` of every node n (``x``: the global copy,
``s_n``: replica n's values then) is averaged over the nodes; after step ``t + d`` the outer optimizer steps ``x``
with that average as its gradient, and every replica becomes ``x + (its values now - s_n)``. With
``sync_warmup_steps=W`` the first W steps are synchronous (every replica steps with the mean gradient of all
ranks), ``x`` starts from the parameters after step W, and the schedule counts the steps after it.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest
import torch

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.sync import SyncSchedule, build_outer_optimizer, fragment_bounds
from ddp_plugin.testing.processes import clean_env, runs_argument
from ddp_plugin.testing.ranks import free_port
from tests.support import ROOT, interpreter, run_python
from tests.workers import sync_run

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
ATOL = 1e-5


# ---------------------------------------------------------------------------------------------- the reference


def reference(steps: int, every: int, outer: str, fragments: int = 1, staleness: int = 0, inner: str = "sgd",
              warmup: int = 0, batch_sizes: str = "") -> torch.Tensor:
    """Every node's parameters after every step (steps x nodes x parameters), by the definition above."""
    base = sync_run.model(inner)
    replicas = [copy.deepcopy(base) for _ in range(NODES)]
    optimizers = [r.configure_optimizers() for r in replicas]
    params = [list(r.parameters()) for r in replicas]
    # Bucket order: the reverse of registration (the engine's); fragments are equal ranges of it, flattened.
    order = list(range(len(params[0])))[::-1]

    def flat(n: int) -> torch.Tensor:
        return torch.cat([params[n][i].detach().reshape(-1) for i in order])

    def unflat(n: int, values: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for i in order:
                p = params[n][i]
                p.copy_(values[at : at + p.numel()].view_as(p))
                at += p.numel()

    bounds = fragment_bounds(flat(0).numel(), fragments)
    x = [flat(0)[bounds[f] : bounds[f + 1]].clone() for f in range(fragments)]
    outer_opt = (torch.optim.SGD(x, lr=1.0) if outer == "average"
                 else torch.optim.SGD(x, lr=0.7, momentum=0.9, nesterov=True))
    loader = [sync_run.rank_batches(r, batch_sizes) for r in range(WORLD)]
    pending: dict[int, tuple[int, list[torch.Tensor], list[list[torch.Tensor]]]] = {}
    history = []
    for t in range(1, steps + 1):
        j = (t - 1) % sync_run.STEPS_PER_EPOCH
        for n, (replica, opt) in enumerate(zip(replicas, optimizers)):
            batches = [loader[n * RANKS_PER_NODE + r][j] for r in range(RANKS_PER_NODE)]
            xb, yb = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            opt.zero_grad()
            replica.compute_loss((xb, yb)).backward()
        if t <= warmup:  # synchronous: every node's mean gradient averaged over the nodes
            for ps in zip(*params):
                mean = sum(p.grad for p in ps) / NODES
                for p in ps:
                    p.grad = mean.clone()
        for opt in optimizers:
            opt.step()
        if t <= warmup:
            if t == warmup:
                x = [flat(0)[bounds[f] : bounds[f + 1]].clone() for f in range(fragments)]
                outer_opt = (torch.optim.SGD(x, lr=1.0) if outer == "average"
                             else torch.optim.SGD(x, lr=0.7, momentum=0.9, nesterov=True))
            history.append(torch.stack([torch.cat([p.detach().reshape(-1) for p in ps]) for ps in params]))
            continue
        for f in range(fragments):
            if (t - warmup) % every == ((f + 1) * every // fragments) % every:
                snaps = [flat(n)[bounds[f] : bounds[f + 1]].clone() for n in range(NODES)]
                pending[f] = (t + staleness, sum(x[f] - s for s in snaps) / NODES, snaps)
        for f, (when, mean, snaps) in list(pending.items()):
            if when != t:
                continue
            for g in range(fragments):
                x[g].grad = mean if g == f else None
            outer_opt.step()
            for n in range(NODES):
                values = flat(n)
                values[bounds[f] : bounds[f + 1]] = x[f] + (values[bounds[f] : bounds[f + 1]] - snaps[n])
                unflat(n, values)
            del pending[f]
        history.append(torch.stack([torch.cat([p.detach().reshape(-1) for p in ps]) for ps in params]))
    return torch.stack(history)


def run_args(d, name: str, flags: dict, inner: str = "sgd", steps: int = 12, *extra: str) -> list:
    return ["--out", d / f"{name}.pt", "--flags", json.dumps(flags), "--inner", inner, "--steps", str(steps), *extra]


def distributed(tmp_path, name: str, flags: dict, inner: str = "sgd", steps: int = 12, *extra: str) -> dict:
    run_python("-m", "tests.workers.sync_run", *run_args(tmp_path, name, flags, inner, steps, *extra))
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


VARIANTS = {
    "local_sgd": ({"sync_every": 4, "outer_optimizer": "average"}, "sgd"),
    "diloco": ({"sync_every": 4, "outer_optimizer": "nesterov"}, "sgd"),
    "fragments": ({"sync_every": 4, "outer_optimizer": "nesterov", "sync_fragments": 2}, "sgd"),
    "staleness": ({"sync_every": 4, "outer_optimizer": "nesterov", "sync_fragments": 2, "max_staleness": 1}, "sgd"),
    "stage2_node": ({"sync_every": 4, "outer_optimizer": "nesterov", "zero_stage": 2, "shard_scope": "node"},
                    "adamw"),
    "warmup": ({"sync_every": 4, "outer_optimizer": "nesterov", "sync_fragments": 2, "max_staleness": 1,
                "sync_warmup_steps": 3}, "sgd"),
    "stage3_node": ({"sync_every": 4, "outer_optimizer": "nesterov", "zero_stage": 3, "shard_scope": "node",
                     "sync_fragments": 2, "max_staleness": 1}, "adamw"),
    # A DiLoCo sync in windows of 5 values per share (the model's parts are about 110 values).
    "diloco_windows": ({"sync_every": 4, "outer_optimizer": "nesterov", "sync_window_bytes": 40}, "sgd"),
    # A plugin of the user's answers for the pseudo-gradients (as a codec would): the outer state is kept per node.
    "diloco_node_state": ({"sync_every": 4, "outer_optimizer": "nesterov", "user_mean": True}, "sgd"),
    "staleness_node_state": ({"sync_every": 4, "outer_optimizer": "nesterov", "sync_fragments": 2,
                              "max_staleness": 1, "user_mean": True}, "sgd"),
}


SPARSELOCO = {"sync_every": 4, "outer_optimizer": "average", "compression": "sparse",
              "compression_options": {"decay": 0.95, "density": 0.1, "chunk": 64, "bits": 2}}
"""SparseLoCo's recipe (the decayed error feedback standing in for the outer momentum), chunks small enough for
the tiny model to have several; and the same streamed, 2 fragments a step late."""
SPARSELOCO_STREAMING = {**SPARSELOCO, "sync_fragments": 2, "max_staleness": 1}
SPARSELOCO_WARMUP = {**SPARSELOCO, "compression_options": {**SPARSELOCO["compression_options"], "warmup_syncs": 1}}
"""With the first sync dense in int8 (``warmup_syncs``), then sparse."""
SPARSELOCO_4_NODES = {**SPARSELOCO, "devices_per_node": 1}
SPARSELOCO_SCATTERED = {**SPARSELOCO_4_NODES,
                        "compression_options": {**SPARSELOCO["compression_options"], "aggregation": "reduce_scatter"}}
"""SparseLoCo over 4 nodes of 1 rank (the codec's group: 4 ranks), with the reduce-scatter aggregation (its 7 chunks in
ranges of 1, 2, 2 and 2) and with the all-gather; and the reduce-scatter streamed (2 fragments of 4 and 3 chunks, no
staleness)."""
SPARSELOCO_SCATTERED_STREAMING = {**SPARSELOCO_SCATTERED, "sync_fragments": 2}
SPARSE_SCATTERED_ELSEWHERE = {
    # ZeRO 2 over each node's 2 ranks: the codec reduces each rank's shard of the pseudo-gradients over the 2 nodes.
    "stage2_node": {**SPARSELOCO, "compression_options": SPARSELOCO_SCATTERED["compression_options"], "zero_stage": 2,
                    "shard_scope": "node"},
    # No sync mode: every step's gradients, over 4 nodes.
    "gradients": {"devices_per_node": 1, "compression": "sparse",
                  "compression_options": {"density": 0.1, "chunk": 64, "aggregation": "reduce_scatter"}},
}


SHARDED = ({"sync_every": 4, "sync_fragments": 2, "max_staleness": 1, "zero_stage": 2, "shard_scope": "node",
            "checkpoint": "sharded"}, "adamw")
UNEVEN_SIZES = "4,4,2,1"  # node 0: 8 samples a step, node 1: 3
COMPOSE_TRAINER = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "precision": "bf16-mixed"}
COMPOSE_STAGES = {"stage0": {}, "stage2_node": {"zero_stage": 2, "shard_scope": "node"}}
RESUMED = ("staleness", "stage2_node", "stage2_node_sharded_checkpoint", "staleness_node_state")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every training run of this module but the dead-rank one, one after another in one launch of 4 ranks (a
    launch costs seconds, a run's fit a fraction of one); later runs resume from checkpoints earlier ones wrote."""
    d = tmp_path_factory.mktemp("sync")
    todo = {name: run_args(d, name, flags, inner) for name, (flags, inner) in VARIANTS.items()}
    todo["uneven"] = run_args(d, "uneven", {"sync_every": 4, "weighting": "sample"}, "sgd", 8,
                              "--batch-sizes", UNEVEN_SIZES)
    todo["today"] = run_args(d, "today", {})
    todo["one"] = run_args(d, "one", {"sync_every": 1, "outer_optimizer": "average"})
    todo["sparseloco"] = run_args(d, "sparseloco", SPARSELOCO)
    todo["sparseloco_streaming"] = run_args(d, "sparseloco_streaming", SPARSELOCO_STREAMING)
    todo["sparseloco_warmup"] = run_args(d, "sparseloco_warmup", SPARSELOCO_WARMUP)
    todo["sparseloco_4_nodes"] = run_args(d, "sparseloco_4_nodes", SPARSELOCO_4_NODES)
    todo["sparseloco_scattered"] = run_args(d, "sparseloco_scattered", SPARSELOCO_SCATTERED)
    todo["sparseloco_scattered_streaming"] = run_args(d, "sparseloco_scattered_streaming",
                                                      SPARSELOCO_SCATTERED_STREAMING)
    for name, flags in SPARSE_SCATTERED_ELSEWHERE.items():
        todo[f"sparse_scattered_{name}"] = run_args(d, f"sparse_scattered_{name}", flags)
    for stage, flags in COMPOSE_STAGES.items():
        todo[f"compose_{stage}"] = run_args(d, f"compose_{stage}", {"sync_every": 4, **flags}, "adamw", 8,
                                            "--trainer", json.dumps(COMPOSE_TRAINER), "--scheduler")
    # Resumed mid-cycle with a sync in flight: the first 6 steps save, the resumed run goes on to 12.
    todo["stage2_node_sharded_checkpoint"] = run_args(d, "stage2_node_sharded_checkpoint", *SHARDED)
    for name in RESUMED:
        flags, inner = VARIANTS.get(name, SHARDED)
        ckpt = d / f"{name}-mid.ckpt"
        todo[f"{name}/first"] = run_args(d, f"{name}-first", flags, inner, 6, "--save-at", "6", "--ckpt", ckpt)
        todo[f"{name}/resumed"] = run_args(d, f"{name}-resumed", flags, inner, 12, "--resume", ckpt)
    # The outer state saved per node (a plugin answering for the pseudo-gradients) resumed sharded over the nodes.
    todo["layouts/resumed"] = run_args(d, "layouts-resumed", *VARIANTS["staleness"], 12, "--resume",
                                       d / "staleness_node_state-mid.ckpt")
    # A synchronous checkpoint resumed in a sync mode, and that one resumed synchronously.
    sync_ckpt, mode_ckpt = d / "sync.ckpt", d / "mode.ckpt"
    todo["sync_a"] = run_args(d, "sync_a", {}, "sgd", 6, "--save-at", "6", "--ckpt", sync_ckpt)
    todo["sync_b"] = run_args(d, "sync_b", VARIANTS["diloco"][0], "sgd", 12, "--resume", sync_ckpt,
                              "--save-at", "12", "--ckpt", mode_ckpt)
    todo["sync_c"] = run_args(d, "sync_c", {}, "sgd", 18, "--resume", mode_ckpt)
    run_python("-m", "tests.workers.sync_run", *runs_argument(todo.values()), timeout=300 + 30 * len(todo))
    return {name: torch.load(args[1], weights_only=False) for name, args in todo.items()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_three_outer_cycles_equal_the_one_process_reference(runs, name):
    flags, inner = VARIANTS[name]
    ref = reference(12, flags["sync_every"], flags["outer_optimizer"], flags.get("sync_fragments", 1),
                    flags.get("max_staleness", 0), inner, flags.get("sync_warmup_steps", 0))
    got = runs[name]["history"]  # steps x ranks x parameters
    for rank in range(WORLD):
        torch.testing.assert_close(got[:, rank], ref[:, rank // RANKS_PER_NODE], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_ranks_of_a_node_hold_the_same_bits_after_every_step(runs, name):
    got = runs[name]["history"]
    for node in range(NODES):
        first = node * RANKS_PER_NODE
        for rank in range(first + 1, first + RANKS_PER_NODE):
            assert torch.equal(got[:, rank], got[:, first])


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "stage2_node", "diloco_windows"])
def test_every_rank_holds_the_same_bits_right_after_a_full_sync(runs, name):
    got = runs[name]["history"]
    for t in (4, 8, 12):  # steps after which the single fragment was synced (staleness 0)
        assert all(torch.equal(got[t - 1, r], got[t - 1, 0]) for r in range(WORLD))
    assert not torch.equal(got[2, 0], got[2, RANKS_PER_NODE])  # in between, the nodes drift apart


@pytest.mark.parametrize("name", ["local_sgd", "diloco", "fragments", "staleness", "stage2_node", "stage3_node"])
def test_nothing_crosses_nodes_but_the_outer_syncs(runs, name):
    """Between syncs a node is a replica of its own: a step's bookkeeping (which parameters got a gradient)
    agrees inside the node, so no rank sends a byte across nodes until the first sync; and every sync carries
    exactly its fragment's bytes."""
    flags, _ = VARIANTS[name]
    schedule = SyncSchedule(flags["sync_every"], flags.get("sync_fragments", 1), flags.get("max_staleness", 0))
    first = min(t for t in range(1, 13) if schedule.sent_after(t))
    sent = runs[name]["cross_node_MB"] * 1e6  # steps x ranks, bytes so far
    assert sent.shape == (12, WORLD)
    assert (sent[:first] == 0).all(), sent[:first]  # (the first sync is sent after step `first`)
    assert (sent[-1] > 0).all()
    if schedule.fragments == 1:
        whole = sum(p.numel() * 4 for p in sync_run.model("sgd").parameters())  # S, fp32
        # With the outer state sharded over the nodes (the plain mean), a rank's part of the bucket (the model is
        # one) is reduce-scattered and all-gathered in n equal shares: at most n - 1 padding values per part and
        # direction, in each of the 3 syncs.
        padding = 3 * RANKS_PER_NODE * 2 * (NODES - 1) * 4
        for node in range(NODES):
            total = float(sent[-1, node * RANKS_PER_NODE : (node + 1) * RANKS_PER_NODE].sum())
            extra = total - round(total / whole) * whole
            assert 0 <= extra <= padding, (node, total, whole)


def test_sparseloco_leaves_every_rank_with_the_same_bits_after_each_sync_and_sends_a_fraction(runs):
    """``compression="sparse"`` with a decayed accumulator and ``outer_optimizer="average"``: each node gathers the
    others' sparse pseudo-gradients and decodes them in rank order, so every rank holds the same bits right after
    each sync (and the nodes drift apart in between); streamed with staleness, the ranks of a node stay one replica
    every step. What crossed is a fraction of what the same fp32 syncs send."""
    got = runs["sparseloco"]["history"]
    for t in (4, 8, 12):
        assert all(torch.equal(got[t - 1, r], got[t - 1, 0]) for r in range(WORLD)), t
    assert not torch.equal(got[2, 0], got[2, RANKS_PER_NODE])
    assert not torch.equal(got[-1], runs["local_sgd"]["history"][-1])  # (coded: not the plain mean's result)
    for name in ("sparseloco", "sparseloco_streaming"):
        history = runs[name]["history"]
        assert torch.isfinite(history).all()
        for node in range(NODES):
            first = node * RANKS_PER_NODE
            assert all(torch.equal(history[:, r], history[:, first]) for r in range(first + 1, first + RANKS_PER_NODE)), name
    coded, plain = runs["sparseloco"]["cross_node_MB"][-1].sum(), runs["local_sgd"]["cross_node_MB"][-1].sum()
    assert 0 < coded < plain / 2, (coded, plain)


def test_sparseloco_warmup_syncs_leave_every_rank_with_the_same_bits_after_each_sync(runs):
    """``warmup_syncs=1``: the first sync crosses in int8, the later ones sparse; every rank holds the same bits right
    after each (the nodes drift apart in between). The int8 sync sends more than a sparse one, far less than fp32;
    the run differs from the one without warmup."""
    warm, cold = runs["sparseloco_warmup"], runs["sparseloco"]
    got = warm["history"]
    assert torch.isfinite(got).all()
    for t in (4, 8, 12):
        assert all(torch.equal(got[t - 1, r], got[t - 1, 0]) for r in range(WORLD)), t
    assert not torch.equal(got[2, 0], got[2, RANKS_PER_NODE])
    assert not torch.equal(got[-1], cold["history"][-1])
    sent, sparse, plain = (r["cross_node_MB"][-1].sum() for r in (warm, cold, runs["local_sgd"]))
    assert sparse < sent < plain / 2, (sparse, sent, plain)


def bucket_order_fragment(history: torch.Tensor, fragment: int, fragments: int) -> torch.Tensor:
    """Fragment ``fragment`` of every rank's parameters in ``history`` (... x parameters, in registration order): the
    parameters flattened in bucket order (the reverse of registration), cut as the sync mode cuts them."""
    sizes = [p.numel() for p in sync_run.model("sgd").parameters()]
    flat = torch.cat(history.split(sizes, dim=-1)[::-1], dim=-1)
    bounds = fragment_bounds(flat.shape[-1], fragments)
    return flat[..., bounds[fragment] : bounds[fragment + 1]]


def test_sparse_reduce_scatter_leaves_every_rank_the_same_bits_after_each_sync_and_sends_less(runs):
    """``compression_options={"aggregation": "reduce_scatter"}`` over 4 nodes: each owner sums its range of chunks
    and codes it again, every rank decodes the same gathered ranges, so every rank holds the same bits right after
    each sync (and the nodes drift apart in between); streamed, each fragment right after its own sync. It sends
    fewer bytes across nodes than the all-gather of the same run."""
    got = runs["sparseloco_scattered"]["history"]
    assert torch.isfinite(got).all()
    for t in (4, 8, 12):
        assert all(torch.equal(got[t - 1, r], got[t - 1, 0]) for r in range(WORLD)), t
    assert not torch.equal(got[2, 0], got[2, 1])
    assert not torch.equal(got[-1], runs["sparseloco_4_nodes"]["history"][-1])  # (the owners code the mean again)
    streamed = runs["sparseloco_scattered_streaming"]["history"]
    for t, fragment in ((2, 0), (4, 1), (6, 0), (8, 1), (10, 0), (12, 1)):
        synced = bucket_order_fragment(streamed[t - 1], fragment, 2)
        assert all(torch.equal(synced[r], synced[0]) for r in range(WORLD)), (t, fragment)
        other = bucket_order_fragment(streamed[t - 1], 1 - fragment, 2)
        assert not all(torch.equal(other[r], other[0]) for r in range(WORLD)), (t, fragment)
    scattered = runs["sparseloco_scattered"]["cross_node_MB"][-1]
    gathered = runs["sparseloco_4_nodes"]["cross_node_MB"][-1]
    assert (scattered > 0).all() and (scattered < 0.8 * gathered).all(), (scattered, gathered)


def test_sparse_reduce_scatter_keeps_every_rank_the_same_bits_on_zero_shards_and_on_gradients(runs):
    """The reduce-scatter aggregation on each rank's ZeRO 2 shard of the pseudo-gradients (2 nodes of 2), and on every
    step's gradients without a sync mode (4 nodes): every rank the same bits after each sync, and after every step."""
    got = runs["sparse_scattered_stage2_node"]["history"]
    for t in (4, 8, 12):
        assert all(torch.equal(got[t - 1, r], got[t - 1, 0]) for r in range(WORLD)), t
    assert not torch.equal(got[2, 0], got[2, RANKS_PER_NODE])
    got = runs["sparse_scattered_gradients"]["history"]
    assert torch.isfinite(got).all() and not torch.equal(got[0, 0], got[-1, 0])
    for t in range(len(got)):
        assert all(torch.equal(got[t, r], got[t, 0]) for r in range(WORLD)), t


def test_warmup_steps_are_synchronous_and_the_sync_mode_starts_after_them(runs):
    got = runs["warmup"]["history"]
    for t in range(3):  # steps 1-3: gradients averaged over every rank, so every rank holds the same bits
        assert all(torch.equal(got[t, r], got[t, 0]) for r in range(WORLD)), t
    assert not torch.equal(got[3, 0], got[3, RANKS_PER_NODE])  # step 4: the nodes train alone


def test_replicas_drift_between_syncs_and_the_metrics_say_so(runs):
    metrics = runs["diloco"]["metrics"]
    assert metrics["sync/outer_syncs"] > 0 and metrics["sync/drift"] > 0
    assert "sync/wait_ms" in metrics
    assert runs["stage2_node"]["memory"]["outer_state"] > 0


def test_sample_weighting_weighs_the_samples_of_the_node(runs):
    """With ``weighting="sample"`` and uneven batches, a replica's step is the mean over its node's samples (the
    reference trains each replica on its node's concatenated batch), not scaled by the node's share of the
    world's samples."""
    ref = reference(8, 4, "nesterov", batch_sizes=UNEVEN_SIZES)
    for rank in range(WORLD):
        torch.testing.assert_close(runs["uneven"]["history"][:, rank], ref[:, rank // RANKS_PER_NODE], atol=ATOL,
                                   rtol=0)


def test_sync_every_1_is_todays_synchronous_training(runs):
    assert torch.equal(runs["today"]["history"], runs["one"]["history"])


@pytest.mark.parametrize("stage", list(COMPOSE_STAGES))
def test_sync_modes_compose_with_accumulation_clipping_a_scheduler_and_bf16(runs, stage):
    run = runs[f"compose_{stage}"]
    got = run["history"]
    assert got.shape[0] == 8 and torch.isfinite(got).all()
    for t in range(8):  # a node is one replica every step; the nodes agree right after each sync
        for node in range(NODES):
            assert torch.equal(got[t, node * RANKS_PER_NODE + 1], got[t, node * RANKS_PER_NODE])
        synced = (t + 1) % 4 == 0
        assert torch.equal(got[t, 0], got[t, RANKS_PER_NODE]) == synced, t
    assert run["metrics"]["sync/outer_syncs"] == pytest.approx(2 / 8)


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name", RESUMED)
def test_resume_mid_cycle_with_a_sync_in_flight_continues_exactly(runs, name):
    torch.testing.assert_close(runs[f"{name}/resumed"]["history"][-1], runs[name]["history"][-1], atol=0, rtol=0)


def test_the_outer_state_saved_per_node_resumes_sharded_over_the_nodes(runs):
    # (the same file: the global copy and the outer momentum are saved whole, per parameter, in either layout)
    ref = reference(12, 4, "nesterov", fragments=2, staleness=1)
    for rank in range(WORLD):
        torch.testing.assert_close(runs["layouts/resumed"]["history"][:, rank], ref[6:, rank // RANKS_PER_NODE],
                                   atol=ATOL, rtol=0)


KILL_TIMEOUT_S = 8  # short: under torchrun every survivor waits it out (see the test)


def test_a_rank_dead_during_an_outer_sync_makes_the_others_fail_fast_naming_it_and_the_checkpoint_resumes(
        runs, tmp_path):
    # Staleness 1, fragments after steps 2, 4, 6, 8...: rank 3 dies right after step 8, its fragment's average in
    # flight on every rank; the checkpoint of step 6 (an epoch's end) was written before.
    flags, inner = VARIANTS["staleness"]
    ckpt = tmp_path / "last.ckpt"
    cmd = [interpreter(), "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           "-m", "tests.workers.sync_run", "--out", str(tmp_path / "x.pt"), "--flags", json.dumps(flags),
           "--steps", "40", "--save-at", "6", "--ckpt", str(ckpt), "--kill-rank", "3", "--kill-after", "8",
           "--timeout", str(KILL_TIMEOUT_S)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    killed_at = float(re.search(r"rank 3 kills itself \(SIGKILL\) at ([\d.]+)", out).group(1))
    exits = {int(r): float(at) for r, at in re.findall(r"rank (\d) exits after \S+ s \(at ([\d.]+)\)", out)}
    assert set(exits) == {0, 1, 2}, out[-4000:]
    # Each survivor raised within the timeout plus a small margin, and the ones that name a cause name rank 3. (Not
    # sooner: torchrun SIGTERMs the survivors, and Lightning's SIGTERM handler broadcasts over every rank, which
    # waits out the timeout with rank 3 gone.)
    assert all(at - killed_at < KILL_TIMEOUT_S + 10 for at in exits.values()), (exits, killed_at)
    assert re.search(r"rank [012]: .*failed because .*rank 3 stopped responding", out), out[-4000:]
    for because in re.findall(r"failed because (.*?)\. Original error", out):
        assert because == "rank 3 stopped responding (killed, crashed or hung)", because
    # The last checkpoint resumes as if nothing had happened.
    resumed = distributed(tmp_path, "resumed", flags, inner, 12, "--resume", str(ckpt))
    torch.testing.assert_close(resumed["history"][-1], runs["staleness"]["history"][-1], atol=0, rtol=0)


def test_a_synchronous_checkpoint_resumes_in_a_sync_mode_and_back(runs):
    assert torch.isfinite(runs["sync_b"]["history"]).all()
    c = runs["sync_c"]["history"]
    assert torch.isfinite(c).all() and c.shape[0] == 6


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        ({"sync_every": 0}, r"`sync_every=0`.*positive integer"),
        ({"sync_every": 2.5}, r"`sync_every=2.5`"),
        ({"sync_every": 4, "outer_optimizer": "adam"}, r"`outer_optimizer='adam'`.*'average', 'nesterov'"),
        ({"sync_every": 4, "max_staleness": 4}, r"`max_staleness=4`.*less than `sync_every=4`"),
        ({"sync_every": 4, "max_staleness": -1}, r"`max_staleness=-1`"),
        ({"sync_every": 4, "sync_fragments": 0}, r"`sync_fragments=0`"),
        ({"sync_every": 4, "sync_fragments": 5}, r"`sync_fragments=5`.*at most `sync_every=4`"),
        ({"sync_every": 4, "zero_stage": 2}, r"`shard_scope='global'`.*`sync_every=4`.*shard_scope='node'"),
        ({"sync_every": 4, "sync_warmup_steps": -1}, r"`sync_warmup_steps=-1`"),
        ({"sync_warmup_steps": 100}, r"`sync_warmup_steps=100` needs a sync mode \(`sync_every` > 1\)"),
    ],
)
def test_bad_sync_flags_fail_at_construction_naming_the_flag(flags, pattern):
    with pytest.raises(ValueError, match=pattern):
        HierarchicalZeroStrategy(**flags)


def test_more_fragments_than_parameters_fail_at_setup_naming_the_flag(tmp_path):
    proc = run_python("-m", "tests.workers.sync_run", "--out", tmp_path / "x.pt", "--steps", "2", "--flags",
                      json.dumps({"sync_every": 8, "sync_fragments": 8}), check=False)
    assert proc.returncode != 0
    assert "`sync_fragments=8` is more than the 6 trainable parameters" in proc.stdout + proc.stderr


def test_schedule_staggers_fragments_and_delays_by_the_staleness():
    s = SyncSchedule(every=8, fragments=4, staleness=1)
    assert [t for t in range(1, 17) if s.sent_after(t)] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert s.sent_after(8) == [3] and s.applied_after(9) == [3]
    assert SyncSchedule(every=4).sent_after(4) == [0] and not SyncSchedule(every=4).sent_after(3)


def test_fragments_are_contiguous_ranges_of_equal_size():
    assert fragment_bounds(40, 4) == [0, 10, 20, 30, 40]
    assert fragment_bounds(102, 3) == [0, 34, 68, 102]  # across parameters: sizes 100, 1, 1 make no difference
    assert fragment_bounds(10, 3) == [0, 3, 6, 10]
    with pytest.raises(ValueError):
        fragment_bounds(3, 4)


def test_diloco_outer_optimizer_is_torchs_nesterov_sgd_to_the_bit_without_a_gradient_sized_temporary():
    torch.manual_seed(0)
    start = torch.randn(1000)
    grads = [torch.randn(1000) for _ in range(4)]
    ours_p, torch_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = build_outer_optimizer("nesterov", [ours_p])
    reference = torch.optim.SGD([torch_p], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        ours_p.grad, torch_p.grad = g.clone(), g.clone()
        storages = {ours_p.grad.untyped_storage().data_ptr()}
        ours.step()
        reference.step()
        assert torch.equal(ours_p, torch_p)
        assert ours_p.grad.untyped_storage().data_ptr() in storages  # the Nesterov term went into the gradient
    assert torch.equal(ours.state[ours_p]["momentum_buffer"], reference.state[torch_p]["momentum_buffer"])
    assert ours.state_dict()["param_groups"] == reference.state_dict()["param_groups"]


def test_a_sync_in_windows_gives_the_same_bits_as_in_one_go(runs):
    # The same sums of the same values, element by element: the windows change what is held at once, not the result.
    assert torch.equal(runs["diloco_windows"]["history"], runs["diloco"]["history"])
    # (the drift is summed window by window: the same up to float rounding)
    assert runs["diloco_windows"]["metrics"]["sync/drift"] == pytest.approx(runs["diloco"]["metrics"]["sync/drift"])


def test_with_the_plain_mean_the_outer_state_is_sharded_over_the_nodes(runs):
    # Rank 0 keeps the global copy and outer momentum of 1/n of its chunk (the first share, rounded up): 2S/N,
    # where with a plugin answering for the pseudo-gradients it keeps them for its whole chunk, 2S/k.
    sharded = runs["diloco"]["memory"]["outer_state"]
    per_node = runs["diloco_node_state"]["memory"]["outer_state"]
    S = sum(p.numel() * 4 for p in sync_run.model("sgd").parameters())
    assert per_node == pytest.approx(2 * S / RANKS_PER_NODE, abs=2 * 4)
    assert per_node / NODES <= sharded <= per_node / NODES + 2 * 4 * (NODES - 1), (sharded, per_node)
