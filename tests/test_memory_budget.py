"""The memory budget of every setting (docs/zero.md#memory-budget): the most a training step holds on the heap, per
rank, held to the budget's formula, and for the synchronous stage-0 paths to what Lightning ``ddp`` holds in the
same launch.

One launch of 4 ranks (2 simulated nodes x 2) trains the same MLP with AdamW under every setting in turn
(tests/workers/memory_run.py), with the heap tracker of ``ddp_plugin.testing.heap`` in ``LD_PRELOAD``: it counts
every byte ``malloc``-ed and not yet freed, by every thread (the communication thread's codec scratch, gloo's
buffers, autograd's gradients), and the highest count of each step. A regression test, not a timing: a buffer
that comes back per step (a bucket-sized temporary in a codec or a collective) or one kept for good shows up
as bytes above the budget, whatever the machine's speed.
"""

from __future__ import annotations

import json

import pytest

from ddp_plugin.codecs.int8 import ROW_BLOCK_VALUES
from ddp_plugin.runtime.comm import RS_PIECE_BYTES
from ddp_plugin.sync.plugin import WINDOW_BYTES
from ddp_plugin.testing import heap
from tests.support import WORKERS, run_python

pytestmark = pytest.mark.skipif(heap.compiler() is None, reason="the heap tracker is compiled with cc or gcc")

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
SETTINGS = ["ddp", "flat", "hier", "hier_fp16", "hier_int8", "hier_powersgd", "flat_int8", "diloco", "streaming",
            "streaming_int8", "zero1", "zero2", "zero3", "zero3_prefetch1", "zero3_in_backward"]
AT_MOST_DDP = ["flat", "hier", "hier_fp16", "hier_int8", "hier_powersgd", "diloco", "streaming"]
"""The stage-0 paths that hold no more than Lightning ``ddp``, which keeps its reducer's buckets beside the
gradients (S), where ours reduce the gradients where they lie: the synchronous ones, and the sync modes with the
plain mean, whose outer state (2S/N) is sharded over every rank. (A codec's sync mode keeps its outer state per
node, 2S/k: S on this launch's two ranks per node, beside the codec's residuals.)"""
FRAGMENTS = 4  # the worker's streaming settings: sync_every=4, sync_fragments=4, max_staleness=1


def budget(setting: str, m: dict) -> float:
    """Bytes a rank may hold at a step's peak above the model's parameters: what it keeps between steps plus
    what a step adds. The formulas of docs/zero.md's table: S gradient bytes (= parameter bytes, fp32), AdamW
    state 2S, B the largest bucket, G the largest parameter, U the largest stage 3 unit, k ranks per node, n
    nodes, N ranks, F fragments."""
    S, B, G, U = m["grads"], m["largest_bucket"], m["largest_param"], m["largest_unit"]
    k, n, N, F = PER_NODE, NODES, WORLD, FRAGMENTS
    step = 2 * G  # autograd's fresh gradient of a parameter before it lands in its bucket; gloo's ring chunks
    piece = min(B / k, RS_PIECE_BYTES)  # the communicator's arena: the reduce-scatter receives a piece of a chunk
    int8_work = 2 * min(B / k, ROW_BLOCK_VALUES * 4)  # int8's two float work buffers (blocks of rows of a shard)
    # Sync modes: the global copy and outer momentum of this rank's share of its chunk, sharded over the nodes with
    # the plain mean (2S/N), of its whole chunk with a codec (2S/k).
    outer, outer_codec = 2 * S / N, 2 * S / k
    node_mean = min(B, RS_PIECE_BYTES) / 2  # gloo's all-reduce of a piece of a bucket over the node: half of it
    share_piece = min(B / (k * n), RS_PIECE_BYTES)  # the reduce-scatter over the nodes receives a piece of a share
    int8_state = S / k + S / (k * n)  # int8's residuals: the shard's, and its chunk's of the mean
    fragment = S / (k * F)  # this rank's part of a fragment
    # Streaming (staleness 1): this rank's part of the fragment in flight (the sync applied is freed before the
    # next is sent; its parts are broadcast inside the node straight into the parameters). Plain mean: its
    # snapshot, its share, the stepped copy gathered over the nodes (the update); with a codec: its snapshot, its
    # pseudo-gradient (the update), and int8's codes of it.
    streaming = 2 * fragment + fragment / n
    streaming_codec = 3 * fragment
    return {
        "ddp": 4 * S + step + G,  # (+ its all-reduce's work buffers, about a parameter's size here)
        "flat": 3 * S + step,
        "hier": 3 * S + piece + step,
        "hier_fp16": 3 * S + max(piece, B / (2 * k)) + step,  # the shard cast into the arena
        # + the int8 codes sent; the codes received and the work buffers share the arena with the piece
        "hier_int8": 3 * S + max(piece, B / (4 * k) + int8_work) + int8_state + B / (4 * k) + step,
        # + residual, the uncompressed part's mask, and that part gathered (its values and their int64 indices,
        # bounded by a shard)
        "hier_powersgd": 3 * S + piece + S / k + S / (4 * k) + B / k + step,
        # the whole bucket is coded: residuals S and S/N, codes 2 x B/4, work buffers of a whole bucket's rows
        "flat_int8": 3 * S + S + S / N + B / 2 + 2 * min(B, ROW_BLOCK_VALUES * 4) + step,
        # at a sync: every share of the mean (S/N) and a window of a bucket's part of the replica (at most
        # WINDOW_BYTES); in a backward the node's mean of a bucket, a piece at a time
        "diloco": 3 * S + outer + max(S / N + min(B / k, WINDOW_BYTES) + share_piece, node_mean) + step,
        "streaming": 3 * S + outer + streaming + share_piece + node_mean + step,
        "streaming_int8": 3 * S + outer_codec + streaming_codec + int8_state + node_mean + step,
        "zero1": S + 2 * S / N + piece + B / k + step,  # whole gradients, 1/N of the state, the node's block
        # + the bucket a backward fills and the one being reduced (a released bucket is allocated again only once at
        # most one is in the communication thread's hands)
        "zero2": 3 * S / N + piece + B / k + 2 * B + step,
        "zero3": -S + 4 * S / N + piece + B / k + 2 * B + 3 * U + step,  # parameters sharded; a unit + two prefetched
        "zero3_prefetch1": -S + 4 * S / N + piece + B / k + 2 * B + 2 * U + step,
        # each bucket's gradient shard is freed once stepped, in backward: the one being stepped (B/N) instead of S/N
        "zero3_in_backward": -S + 3 * S / N + B / N + piece + B / k + 2 * B + 3 * U + step,
    }[setting]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, heap_env) -> dict:
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    run_python(WORKERS / "memory_run.py", "--out", out, "--runs", ",".join(SETTINGS), "--devices", str(WORLD),
               "--devices-per-node", str(PER_NODE), "--width", "768", "--layers", "4", "--bucket-mb", "4",
               env=heap_env, timeout=900)
    return json.loads(out.read_text())


def slack(m: dict) -> float:
    """What the formulas leave out: activations of a batch of 8, Lightning's and Python's own objects."""
    return 0.1 * m["grads"] + 2**20


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_steps_peak_stays_within_the_budget(measured, setting):
    for rank, m in enumerate(measured[setting]):
        limit = budget(setting, m) + slack(m)
        assert m["peak"] <= limit, (
            f"{setting}, rank {rank}: {m['peak'] / 1e6:.2f} MB at a step's peak (kept {m['kept'] / 1e6:.2f} +"
            f" step {m['step'] / 1e6:.2f}) above the parameters, budget {limit / 1e6:.2f} MB"
            f" (S = {m['grads'] / 1e6:.2f} MB)")


@pytest.mark.parametrize("setting", AT_MOST_DDP)
def test_stage_0_paths_hold_no_more_than_lightning_ddp(measured, setting):
    ddp = max(m["peak"] for m in measured["ddp"])
    ours = max(m["peak"] for m in measured[setting])
    assert ours <= ddp, f"{setting}: {ours / 1e6:.2f} MB at a step's peak, Lightning ddp {ddp / 1e6:.2f} MB"


def test_the_tracker_sees_what_the_formulas_name(measured):
    # The measurement itself: ddp keeps gradients, its reducer's buckets and AdamW's state (4 S), ZeRO-3 over 4
    # ranks keeps a quarter of parameters, gradients and state (the full parameters freed: below zero).
    ddp, zero3 = measured["ddp"][0], measured["zero3"][0]
    assert 3.9 * ddp["grads"] <= ddp["kept"] <= 4.3 * ddp["grads"]
    assert zero3["kept"] < 0.5 * zero3["grads"]
    assert all(m["step"] > 0 for runs in measured.values() for m in runs)


def test_stage_3_prefetch_depth_changes_what_is_gathered_not_the_result(measured):
    # Six Linear units: with prefetch_units=2 three are gathered at once, with 1 two; the parameters trained are
    # the same bits.
    two, one = measured["zero3"][0], measured["zero3_prefetch1"][0]
    assert two["digest"] == one["digest"]
    assert 2 * one["largest_unit"] < two["gathered_peak"] <= 3 * two["largest_unit"]
    assert one["gathered_peak"] <= 2 * one["largest_unit"]
