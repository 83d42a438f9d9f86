"""Gradient codecs, one behaviour per test, on 4 real gloo ranks: how close each codec's mean is to the exact
one, that error feedback carries what compression left out, that codec state survives a checkpoint, and that
bad options fail when the strategy is constructed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_plugin import Bucket, HierarchicalZeroStrategy
from ddp_plugin.codecs import BUILTIN_CODECS, dequantize_int8, matrix_segments, quantize_int8
from ddp_plugin.codecs.int8 import ROW_BLOCK_VALUES
from ddp_plugin.runtime.comm import TracedCommunicator
from ddp_plugin.strategy.plugin_manager import available_codecs, build_plugin_manager
from ddp_plugin.testing.ranks import RankPool

WORLD = 4


@pytest.fixture(scope="module")
def ranks():
    with RankPool(WORLD) as pool:
        yield pool


def make_bucket(shapes, index=0) -> Bucket:
    params = tuple(nn.Parameter(torch.zeros(s)) for s in shapes)
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    return Bucket(index=index, buffer=torch.zeros(total), params=params, names=tuple(f"p{i}" for i in range(len(params))),
                  offsets=tuple(offsets))


def inputs(steps, numel, seed=0, scale=1.0):
    """(rank, step, value) inputs, the same on every rank's copy."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(WORLD, steps, numel, generator=g) * scale


# ---------------------------------------------------------------------- functions that run on every rank


def new_codec(name, options, comm=None):
    """A codec as the strategy sets it up: constructed with its options, handed a communicator."""
    codec = BUILTIN_CODECS[name](**options)
    codec.on_setup(comm=comm or TracedCommunicator())
    return codec


def reduce(codec, tensor, bucket):
    return codec.on_cross_node_reduce(tensor=tensor, group=dist.group.WORLD, bucket=bucket, offset=0).wait()


def reduce_steps(rank, world, name, options, shapes, data, save=False):
    """Feed this rank's inputs to a fresh codec, step by step; return the outputs and the codec's state."""
    codec = new_codec(name, options)
    bucket = make_bucket(shapes)
    outs = []
    for step in range(data.shape[1]):
        tensor = data[rank, step].clone()
        reduce(codec, tensor, bucket)
        outs.append(tensor)
    saved = codec.on_save_state_dict() if save else None
    return torch.stack(outs), codec.states[0].as_dict() if 0 in codec.states else {}, saved


def resume_step(rank, world, name, options, shapes, data):
    """Run all but the last step, save, load into a new codec, and run the last step on both codecs."""
    codec = new_codec(name, options)
    bucket = make_bucket(shapes)
    for step in range(data.shape[1] - 1):
        reduce(codec, data[rank, step].clone(), bucket)
    saved, rank_saved = codec.on_save_state_dict(), codec.on_save_rank_state_dict()
    resumed = new_codec(name, options)
    resumed.on_load_state_dict(state=saved or {}, rank_state=rank_saved)
    outs = []
    for c in (codec, resumed):
        tensor = data[rank, -1].clone()
        reduce(c, tensor, bucket)
        outs.append(tensor)
    return outs, {"shared": saved, "rank": rank_saved}


# ---------------------------------------------------------------------- every codec


@pytest.mark.parametrize("name", list(BUILTIN_CODECS))
def test_every_rank_gets_identical_bits(ranks, name):
    options = {"start_iter": 0} if name == "powersgd" else {}
    results = ranks.run(reduce_steps, name, options, [(32, 40), (40,)], inputs(3, 32 * 40 + 40))
    for out, _, _ in results[1:]:
        assert torch.equal(out, results[0][0])


def discarded_try(rank, world, name, options, shapes, data):
    """Step 0 applied; steps 1 and 2 each tried, discarded (``on_cross_node_settled(applied=False)``) and tried
    again, applied (the copies' memory taken again from try to try). On a second codec the same steps without the
    discarded tries. Both outputs, and both codecs' states."""
    tried, plain = new_codec(name, options), new_codec(name, options)
    bucket = make_bucket(shapes)
    outs = {"tried": [], "plain": []}
    for step in range(data.shape[1]):
        attempts = [False, True] if step else [True]
        for applied in attempts:
            tensor = data[rank, step].clone() * (3.0 if not applied else 1.0)  # (the failed try's values differ)
            tried.on_cross_node_try(bucket=bucket)
            tried.on_cross_node_try(bucket=bucket)  # (the same bucket again in one try: its first state is kept)
            reduce(tried, tensor, bucket)
            tried.on_cross_node_settled(applied=applied)
        outs["tried"].append(tensor)
        tensor = data[rank, step].clone()
        reduce(plain, tensor, bucket)
        outs["plain"].append(tensor)
    return outs, tried.states[0].as_dict(), plain.states[0].as_dict()


@pytest.mark.parametrize(("name", "options"),
                         [(n, {"start_iter": 0} if n == "powersgd" else {}) for n in BUILTIN_CODECS]
                         + [("sparse", {"aggregation": "reduce_scatter"})],
                         ids=[*BUILTIN_CODECS, "sparse-reduce_scatter"])
def test_a_discarded_try_leaves_the_codec_as_before_it(ranks, name, options):
    """A try of a step or sync that is not applied anywhere (a replica group lost inside it) and then redone: the
    codec's state (residuals, the reduce-scatter owner's, PowerSGD's Q and count, the warm-up count) is put back as
    before it, so the redone try and every step after it give the same bits as without the discarded one."""
    for outs, tried, plain in ranks.run(discarded_try, name, options, [(32, 40), (40,)], inputs(3, 32 * 40 + 40)):
        for a, b in zip(outs["tried"], outs["plain"]):
            assert torch.equal(a, b)
        assert tried.keys() == plain.keys()
        for key, value in plain.items():
            assert torch.equal(tried[key], value) if isinstance(value, torch.Tensor) else tried[key] == value, key


def kept_memory(rank, world, name, options, shapes, data):
    """Tries applied step after step: where each try's copy of the residuals lies (data pointers)."""
    codec, bucket = new_codec(name, options), make_bucket(shapes)
    where = []
    for step in range(data.shape[1]):
        codec.on_cross_node_try(bucket=bucket)
        reduce(codec, data[rank, step].clone(), bucket)
        codec.on_cross_node_settled(applied=True)
        kept = codec._spare.get(0)  # (none after the first: the bucket had no state before it)
        where.append(tuple(getattr(kept, f).data_ptr() for f in kept.per_rank
                           if isinstance(getattr(kept, f), torch.Tensor)) if kept is not None else ())
    return where


@pytest.mark.parametrize("name", ["int8", "sparse"])
def test_applied_tries_copy_the_residuals_into_the_same_memory_every_step(ranks, name):
    """The copy a try keeps (fault tolerance, every step on the synchronous route) takes the last one's memory
    again: no residual-sized tensor is allocated per step (glibc keeps freed CPU buffers: the resident set would
    grow)."""
    for where in ranks.run(kept_memory, name, {}, [(32, 40), (40,)], inputs(5, 32 * 40 + 40)):
        assert where[1] and len(set(where[1:])) == 1, where


def resize_bucket(rank, world, name, options, before, after, data):
    """Two steps of a bucket of ``before`` shapes, then one of ``after`` shapes under the same index (as a bucket
    rebuilt for another layout, or the link probe's growing sizes); and that last step on a fresh codec."""
    codec = new_codec(name, options)
    for step in range(2):
        reduce(codec, data[rank, step, : sum(torch.Size(s).numel() for s in before)].clone(), make_bucket(before))
    resized, fresh = (data[rank, 2, : sum(torch.Size(s).numel() for s in after)].clone() for _ in range(2))
    reduce(codec, resized, make_bucket(after))
    reduce(new_codec(name, options), fresh, make_bucket(after))
    return resized, fresh


@pytest.mark.parametrize("name", list(BUILTIN_CODECS))
def test_a_bucket_that_changes_size_starts_afresh(ranks, name):
    # PowerSGD used to keep the layout of the first size (which values travel uncompressed) under the bucket's
    # index, and indexed the next size's tensor with it: an IndexError at the link probe's second size.
    options = {"start_iter": 0} if name == "powersgd" else {}
    data = inputs(3, 48 * 40 + 48)
    for resized, fresh in ranks.run(resize_bucket, name, options, [(16, 40), (40,)], [(48, 40), (48,)], data):
        assert torch.equal(resized, fresh)


def test_available_codecs_lists_the_built_ins():
    assert available_codecs()[:5] == ["fp16", "bf16", "int8", "topk", "powersgd"]


@pytest.mark.parametrize("name", list(BUILTIN_CODECS))
def test_builtin_codec_is_registered_under_its_name(name):
    pm = build_plugin_manager(name, [])
    assert type(pm.get_plugin(name)) is BUILTIN_CODECS[name]


# ---------------------------------------------------------------------- fp16 / bf16


@pytest.mark.parametrize(("name", "eps"), [("fp16", 2**-10), ("bf16", 2**-7)])
def test_cast_codec_mean_is_within_its_precision(ranks, name, eps):
    data = inputs(1, 1000)
    out = ranks.run(reduce_steps, name, {}, [(1000,)], data)[0][0][0]
    mean = data[:, 0].mean(0)
    # One rounding of each input (after dividing) and one per addition, each at most eps/2 of the largest value.
    bound = (WORLD + WORLD) * eps / 2 * data.abs().max() / WORLD
    assert (out - mean).abs().max() <= bound


def test_fp16_divides_before_summing_so_large_gradients_do_not_overflow(ranks):
    data = torch.full((WORLD, 1, 8), 40000.0)  # the sum, 160000, is beyond fp16's 65504
    out = ranks.run(reduce_steps, "fp16", {}, [(8,)], data)[0][0][0]
    assert torch.equal(out, torch.full((8,), 40000.0))


# ---------------------------------------------------------------------- int8


def test_int8_quantization_error_is_at_most_half_a_step_per_block():
    x = torch.randn(6, 256) * torch.logspace(-3, 2, 6)[:, None]
    q, scales = quantize_int8(x)
    assert q.dtype == torch.int8
    assert ((x - dequantize_int8(q, scales)).abs() <= scales[:, None] / 2 + 1e-7 * x.abs()).all()


def test_int8_zero_block_stays_zero():
    q, scales = quantize_int8(torch.zeros(2, 16))
    assert torch.equal(dequantize_int8(q, scales), torch.zeros(2, 16))


def test_int8_codes_and_scales_are_their_definition_at_the_edges():
    """q = round(x / s) within +-127 and s = max|row| / 127 (raised to the smallest normal float) on rows at every
    magnitude: subnormal, near the float32 limits, zero, exactly +-127 times a power of two, one NaN or infinity
    (whose scale must be non-finite, and its row dropped by the codec)."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(64, generator=g) * m for m in (1e-44, 1e-40, 1e-38, 1e-3, 1.0, 1e30, 1e36)]
    rows += [torch.zeros(64), torch.linspace(-127, 127, 64) * 2.0 ** -20, torch.rand(64, generator=g) * 254 - 127]
    for bad in (float("nan"), float("inf"), -float("inf")):
        row = torch.randn(64, generator=g)
        row[5] = bad
        rows.append(row)
    x = torch.stack(rows)
    q, scales = quantize_int8(x)
    expected = x.abs().max(dim=1).values.double() / 127
    finite = torch.isfinite(scales)
    assert finite.tolist() == [True] * 10 + [False] * 3
    assert torch.equal(scales[finite], (x[finite].abs().max(dim=1).values / 127))
    normal = finite & (scales >= torch.finfo(torch.float32).tiny)  # (a subnormal quotient keeps fewer bits)
    assert normal.sum() == 6
    assert (scales[normal].double() - expected[normal]).abs().le(expected[normal] * 2.0 ** -24).all()
    s = scales[finite].clamp_min(torch.finfo(torch.float32).tiny)
    reference = torch.div(x[finite], s[:, None]).round().clamp(-127, 127)
    assert torch.equal(q[finite].float(), reference)
    assert q[finite].abs().max() == 127


def test_finite_checks_see_every_non_finite_value_in_every_dtype():
    from ddp_plugin.runtime.finite import all_finite, finite_flag, zero_if_not_finite

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for where in (0, 4095, 9999):
            for bad in (float("nan"), float("inf"), -float("inf")):
                x = torch.randn(10000).to(dtype)
                assert all_finite(x) and bool(finite_flag(x))
                x[where] = bad
                assert not all_finite(x) and not bool(finite_flag(x))
                assert all_finite(x.view(100, 100)[:, ::3]) == bool(where % 100 % 3)  # (strided)
                assert torch.equal(zero_if_not_finite(x), torch.zeros_like(x))
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5))
    z = torch.randn(8, dtype=torch.complex64)
    assert all_finite(z)
    z[3] = complex(float("nan"), 0.0)
    assert not all_finite(z)


def test_int8_mean_error_is_bounded_by_its_two_quantizations(ranks):
    data = inputs(1, 3000, seed=1)
    out = ranks.run(reduce_steps, "int8", {"block_size": 256, "error_feedback": False}, [(3000,)], data)[0][0][0]
    mean = data[:, 0].mean(0)
    # Each rank's values are off by at most half a step (max|x_r| / 254), then the mean's chunk again.
    bound = (data[:, 0].abs().max(dim=1).values.mean() + mean.abs().max()) / 254
    err = (out - mean).abs().max()
    assert err <= bound * 1.001
    assert err > 0  # it is a lossy codec: the test would not notice a codec that sent nothing compressed


def test_int8_sends_a_quarter_of_the_float32_bytes(ranks):
    results = ranks.run(traffic_of, "int8", {"block_size": 1024}, 1 << 16)
    fp32 = 2 * (WORLD - 1) / WORLD * 4 * (1 << 16)
    assert results[0] == pytest.approx(fp32 / 4 * (1 + 4 / 1024), rel=0.01)


def int8_buffers(rank, world, numel):
    """Bytes of every buffer the int8 codec and the communicator keep after a reduce of ``numel`` values."""
    comm = TracedCommunicator()
    codec = new_codec("int8", {}, comm)
    reduce(codec, torch.randn(numel), make_bucket([(numel,)]))
    arenas = sum(a.numel() for a in comm._local.__dict__.get("arenas", {}).values())
    scratch = {key[0]: b.numel() * b.element_size() for key, b in codec.scratch().buffers.items()}
    return arenas, scratch


def test_int8_works_in_its_residual_and_small_buffers_not_a_tensor_sized_float_copy(ranks):
    numel = 1 << 21  # 8 MiB of float32
    work = 2 * ROW_BLOCK_VALUES * 4  # two float blocks of rows
    for arenas, scratch in ranks.run(int8_buffers, numel):
        assert arenas == numel + work < 4 * numel  # the communicator's arena: the codes received and the work
        assert scratch.pop("q") == numel  # the int8 codes sent: a byte per value
        assert sum(scratch.values()) < numel // 64  # the scales


def traffic_of(rank, world, name, options, numel):
    comm = TracedCommunicator(ranks_per_node=1)  # every other rank is on another "node": all traffic counts as cross
    codec = new_codec(name, options, comm)
    reduce(codec, torch.randn(numel), make_bucket([(numel,)]))
    return comm.take_traffic().cross_node_bytes


@pytest.mark.parametrize(
    ("name", "options"), [("int8", {"block_size": 64}), ("topk", {"ratio": 0.1}), ("powersgd", {"start_iter": 0}),
                          ("sparse", {"density": 0.1, "chunk": 64}),
                          ("sparse", {"density": 0.1, "chunk": 64, "aggregation": "reduce_scatter"})]
)
def test_non_finite_gradient_reaches_the_output_and_does_not_poison_later_steps(ranks, name, options):
    data = inputs(2, 512, seed=2)
    data[1, 0, 7] = float("inf")
    results = ranks.run(reduce_steps, name, options, [(16, 32)], data)
    outs, state, _ = results[1]
    assert not torch.isfinite(outs[0]).all()
    assert torch.isfinite(outs[1]).all()
    assert torch.isfinite(state["residual"]).all()
    for _, every, _ in results:  # (the reduce-scatter's owners: the one of the inf's chunk dropped its second residual)
        assert all(torch.isfinite(v).all() for v in every.values() if isinstance(v, torch.Tensor))


def test_int8_non_finite_value_drops_its_ranks_whole_residual_and_its_chunk_owners(ranks):
    # 512 values in 4 chunks (one per rank) of 2 blocks of 64: the NaN is rank 1's value 7, in block 0 of the
    # chunk rank 0 averages. Its block's scale is NaN, and so is the mean's block 0 that everyone decodes.
    data = inputs(1, 512, seed=10)
    data[1, 0, 7] = float("nan")
    results = ranks.run(reduce_steps, "int8", {"block_size": 64}, [(16, 32)], data)
    out = results[0][0][0]
    assert torch.isnan(out[:64]).all() and torch.isfinite(out[64:]).all()
    residuals = [state["residual"] for _, state, _ in results]
    chunk_residuals = [state["chunk_residual"] for _, state, _ in results]
    # The whole residual of the rank that held it, not only its block's; the others keep theirs.
    assert torch.equal(residuals[1], torch.zeros(512))
    assert all(torch.isfinite(r).all() and r.abs().sum() > 0 for i, r in enumerate(residuals) if i != 1)
    # The second quantization's residual of rank 0's chunk of the mean, whole; the other chunks' stay.
    assert torch.equal(chunk_residuals[0], torch.zeros(2, 64))
    assert all(torch.isfinite(r).all() and r.abs().sum() > 0 for r in chunk_residuals[1:])


# ---------------------------------------------------------------------- top-k


def test_topk_sends_the_largest_magnitudes_of_each_rank(ranks):
    data = inputs(1, 1000, seed=3)
    out = ranks.run(reduce_steps, "topk", {"ratio": 0.05, "error_feedback": False}, [(1000,)], data)[0][0][0]
    expected = torch.zeros(1000)
    for r in range(WORLD):
        idx = data[r, 0].abs().topk(50).indices
        expected[idx] += data[r, 0, idx]
    torch.testing.assert_close(out, expected / WORLD)


def test_topk_with_ratio_one_is_the_exact_mean(ranks):
    data = inputs(1, 300, seed=4)
    out = ranks.run(reduce_steps, "topk", {"ratio": 1.0}, [(300,)], data)[0][0][0]
    torch.testing.assert_close(out, data[:, 0].mean(0))


def test_topk_sends_non_finite_values_first_and_drops_the_residual_of_what_it_could_not_send(ranks):
    # A NaN counts as the largest magnitude: up to k of them are sent and leave a finite residual; beyond k the
    # residual would carry NaN into every later step, so that rank's residual is dropped whole.
    data = inputs(1, 500, seed=11)
    data[1, 0, :3] = float("nan")  # k = 50 of 500: all three sent
    data[2, 0, :60] = float("nan")  # ten NaN left behind
    results = ranks.run(reduce_steps, "topk", {"ratio": 0.1}, [(500,)], data)
    residuals = [state["residual"] for _, state, _ in results]
    assert torch.isfinite(residuals[1]).all() and residuals[1].abs().sum() > 0
    assert torch.equal(residuals[2], torch.zeros(500))
    out = results[0][0][0]
    assert torch.isnan(out).sum() >= 50 and torch.isfinite(out[60:]).all()  # rank 2's 50 NaN were sent


# ---------------------------------------------------------------------- sparse (top-k per chunk, low bits)


def test_sparse_keeps_each_chunks_largest_within_half_a_level(ranks):
    # 8 bits, no error feedback: each rank's 10 largest of every chunk of 100, each within half a level (its
    # chunk's largest kept magnitude / 255) of its value; nothing else.
    data = inputs(1, 1000, seed=12)
    options = {"density": 0.1, "chunk": 100, "bits": 8, "error_feedback": False}
    out = ranks.run(reduce_steps, "sparse", options, [(1000,)], data)[0][0][0]
    expected, bound = torch.zeros(1000), torch.zeros(1000)
    for r in range(WORLD):
        rows = data[r, 0].view(10, 100)
        idx = rows.abs().topk(10, dim=1).indices
        kept = torch.zeros(10, 100).scatter_(1, idx, rows.gather(1, idx))
        expected += kept.view(-1)
        bound += (kept != 0).float().view(-1) * (rows.gather(1, idx).abs().amax(1, keepdim=True) / 255).expand(10, 100).reshape(-1)
    assert (out != 0).sum() <= WORLD * 100 and (out != 0).sum() >= 100
    assert ((out - expected / WORLD).abs() <= bound / WORLD + 1e-6).all()


def test_sparse_with_density_one_and_8_bits_is_the_mean_within_half_a_level(ranks):
    data = inputs(1, 256, seed=13)
    out = ranks.run(reduce_steps, "sparse", {"density": 1.0, "chunk": 64, "bits": 8}, [(256,)], data)[0][0][0]
    half_level = data[:, 0].view(WORLD, 4, 64).abs().amax(2).div(255).mean(0).repeat_interleave(64)
    assert ((out - data[:, 0].mean(0)).abs() <= half_level + 1e-6).all()


def test_sparse_sends_its_formula_bytes_far_fewer_than_float32(ranks):
    from ddp_plugin.codecs import SparseCodec

    numel = 65536
    sent = ranks.run(traffic_of, "sparse", {}, numel)
    # (n - 1) payloads of C * (4 + k * (2 + bits / 8)) bytes: 16 chunks of 4096 keeping 62 at 2 bits
    assert sent == [(WORLD - 1) * (16 * 4 + 16 * 62 * 2 + 16 * 62 * 2 // 8)] * WORLD
    assert sent[0] == (WORLD - 1) * SparseCodec().payload_bytes(numel)
    fp32_ring = 2 * (WORLD - 1) / WORLD * 4 * numel
    assert fp32_ring / sent[0] > 57  # (115x on 2 nodes, where the ring sends 4 N and the gather 1 payload)


def test_sparse_decay_zero_forgets_the_residual_and_one_keeps_it(ranks):
    data = inputs(2, 512, seed=14)
    options = {"density": 0.05, "chunk": 128, "bits": 2}
    for decay, same in ((0.0, True), (1.0, False)):
        both = ranks.run(reduce_steps, "sparse", {**options, "decay": decay}, [(512,)], data)[0][0]
        alone = ranks.run(reduce_steps, "sparse", {**options, "decay": decay}, [(512,)], data[:, 1:])[0][0]
        assert torch.equal(both[1], alone[0]) is same


def test_sparse_warmup_syncs_codes_the_first_codings_in_int8_then_sparse_from_an_empty_residual(ranks):
    # The first 2 codings are int8's without error feedback, bit for bit; the third is the sparse coding a fresh
    # codec gives that step's values alone (nothing was owed); every rank holds the same bits at every step.
    data = inputs(3, 512, seed=15)
    sparse = {"density": 0.05, "chunk": 128, "bits": 2, "decay": 0.95}
    results = ranks.run(reduce_steps, "sparse", {**sparse, "warmup_syncs": 2}, [(512,)], data)
    outs, state = results[0][0], results[0][1]
    assert all(torch.equal(r[0], outs) for r in results[1:])
    dense = ranks.run(reduce_steps, "int8", {"error_feedback": False}, [(512,)], data[:, :2])[0][0]
    assert torch.equal(outs[:2], dense)
    alone = ranks.run(reduce_steps, "sparse", sparse, [(512,)], data[:, 2:])[0][0]
    assert torch.equal(outs[2], alone[0])
    assert (outs[2] != 0).sum() < 512 // 4 and state["codings"] == 3


def test_sparse_warmup_syncs_count_survives_a_checkpoint(ranks):
    # Saved after 4 codings of a warmup of 4: the resumed codec's fifth coding is sparse, as the uninterrupted one's.
    options = {"density": 0.05, "chunk": 128, "bits": 4, "warmup_syncs": 4}
    results = ranks.run(resume_step, "sparse", options, [(512,)], inputs(5, 512, seed=16))
    for (uninterrupted, resumed), saved in results:
        assert torch.equal(uninterrupted, resumed) and (resumed != 0).sum() < 512 // 4
        assert saved["shared"]["codec/sparse"][0]["codings"] == 4


# ---------------------------------------------------------------------- sparse, reduce-scatter aggregation


def reduce_in_group(rank, world, size, name, options, shapes, data):
    """The first ``size`` ranks reduce their inputs step by step over a group of them with a fresh codec (the others
    only take part in making the group): the outputs, the codec's state of bucket 0 and the bytes it sent (every
    other rank counted as on another node); ``None`` on the ranks outside."""
    group = dist.group.WORLD if size == world else dist.new_group(list(range(size)))
    if rank >= size:
        return None
    comm = TracedCommunicator(ranks_per_node=1)
    codec = new_codec(name, options, comm)
    bucket = make_bucket(shapes)
    outs = []
    for step in range(data.shape[1]):
        tensor = data[rank, step].clone()
        codec.on_cross_node_reduce(tensor=tensor, group=group, bucket=bucket, offset=0).wait()
        outs.append(tensor)
    return torch.stack(outs), codec.states[0].as_dict(), comm.take_traffic().cross_node_bytes


def owed_by_owners(states, numel, options, size):
    """The owners' second residuals, each at its range of chunks (in the outputs' units: the mean's)."""
    codec = BUILTIN_CODECS["sparse"](**options)
    c, chunks, _ = codec.layout(numel)
    owed = torch.zeros(chunks * c)
    for rank, state in enumerate(states):
        if "owner_residual" not in state:
            continue
        lo, hi = codec.ranges(chunks, size)[rank]
        assert (state["owner_rank"], state["owner_size"]) == (rank, size)
        owed[lo * c : hi * c] = state["owner_residual"][: (hi - lo) * c]
    return owed[:numel]


SCATTERED = {"density": 0.05, "chunk": 64, "bits": 2, "aggregation": "reduce_scatter"}


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("numel", [1000, 100], ids=["16 chunks", "2 chunks"])
def test_sparse_reduce_scatter_leaves_every_rank_the_same_bits_and_owes_the_rest(ranks, size, numel):
    # 16 chunks of 64 over 3 ranks: ranges of 5, 5 and 6 chunks; 2 chunks over 3 or 4: ranks that own none. After
    # every step every rank holds the same bits; summed over the steps, the outputs plus what the ranks' residuals
    # and the owners' second residuals still hold are the exact means: the second coding delays, it loses nothing.
    steps = 4
    data = inputs(steps, numel, seed=20)
    results = [r for r in ranks.run(reduce_in_group, size, "sparse", SCATTERED, [(numel,)], data) if r is not None]
    assert len(results) == size
    outs, states = results[0][0], [r[1] for r in results]
    for other, _, _ in results[1:]:
        assert torch.equal(other, outs)
    assert all("owner_residual" in s for s in states)
    exact = data[:size].mean(0).sum(0)
    owed = torch.stack([s["residual"][:numel] for s in states]).mean(0) + owed_by_owners(states, numel, SCATTERED, size)
    assert (outs.sum(0) - exact).abs().max() > 1e-2  # (the coding did hold something back)
    torch.testing.assert_close(outs.sum(0) + owed, exact, atol=1e-4, rtol=1e-4)


def test_a_sparse_payload_of_zeros_adds_nothing():
    """Zeros are what a failed or skipped collective across replica groups leaves in its output (the quorum's sync
    is thrown away), and both aggregations decode their payloads here: that must add nothing and raise nothing. An
    index is sent less 2**15, so zero bytes read as index 32768, past a chunk of 4096: four of 16 groups of a churn
    run with SparseLoCo's recipe stopped on "index 32768 is out of bounds"."""
    from ddp_plugin.codecs import SparseCodec

    codec = SparseCodec()
    c, chunks, k = codec.layout(3 * 4096)
    total = torch.ones(chunks, c)
    codec._add_decoded(total, torch.zeros(codec.payload_bytes(3 * 4096), dtype=torch.uint8), chunks, k)
    assert torch.equal(total, torch.ones(chunks, c))


def test_sparse_reduce_scatter_sends_about_two_payloads_fewer_than_the_all_gather_on_4_ranks(ranks):
    from ddp_plugin.codecs import SparseCodec

    numel, n = 65536, WORLD
    scattered = ranks.run(traffic_of, "sparse", {"aggregation": "reduce_scatter"}, numel)
    gathered = ranks.run(traffic_of, "sparse", {}, numel)
    payload = SparseCodec().payload_bytes(numel)  # B: 16 chunks of 4096 keeping 62 at 2 bits
    # An all-to-all, then an all-gather, of one range's payload P (4 of the 16 chunks, 574 bytes rounded up to 4):
    # 2 (n - 1) P
    slot = 4 * 4 + 4 * 62 * 2 + 4 * 62 * 2 // 8 + 2
    assert scattered == [2 * (n - 1) * slot] * n == [SparseCodec(aggregation="reduce_scatter").bytes_sent(numel, n)] * n
    assert abs(scattered[0] - 2 * payload * (n - 1) / n) <= 2 * (n - 1) * 4  # (each range rounded up to 4 bytes)
    assert gathered == [(n - 1) * payload] * n and scattered[0] < 0.6 * gathered[0]


@pytest.mark.parametrize("size", [3, 4])
def test_sparse_reduce_scatter_with_density_one_and_8_bits_is_the_mean_within_two_half_levels(ranks, size):
    # Every entry kept: one rounding by each rank (half a level of its chunk's scale: the mean of those), and one
    # by the owner that codes the mean again (half a level of that chunk's largest mean).
    data = inputs(1, 640, seed=21)
    options = {"density": 1.0, "chunk": 64, "bits": 8, "aggregation": "reduce_scatter"}
    out = ranks.run(reduce_in_group, size, "sparse", options, [(640,)], data)[0][0][0]
    mean = data[:size, 0].mean(0)
    first = data[:size, 0].view(size, 10, 64).abs().amax(2).div(255).mean(0)
    second = (mean.view(10, 64).abs().amax(1) + first).div(255)
    assert ((out - mean).abs() <= (first + second).repeat_interleave(64) + 1e-6).all()


def test_sparse_auto_aggregation_takes_the_reduce_scatter_where_it_sends_fewer_bytes():
    from ddp_plugin.codecs import SparseCodec

    auto = SparseCodec(aggregation="auto", chunk=64)
    assert auto.aggregation_for(16 * 64, 2) == "all_gather"  # 2 P = B: no fewer bytes on 2 ranks
    assert auto.aggregation_for(16 * 64, 3) == "reduce_scatter"
    assert auto.aggregation_for(16 * 64, 4) == "reduce_scatter"
    assert auto.aggregation_for(64, 4) == "all_gather"  # one chunk: P = B
    for numel, n in [(16 * 64, 2), (16 * 64, 3), (64, 4), (3 * 64, 4), (1000, 7)]:
        assert auto.bytes_sent(numel, n) == min(SparseCodec(chunk=64).bytes_sent(numel, n),
                                                SparseCodec(chunk=64, aggregation="reduce_scatter").bytes_sent(numel, n))
    assert SparseCodec().aggregation_for(16 * 4096, 8) == "all_gather"  # (the default keeps the all-gather)


def fold_after_steps(rank, world, options, numel, data):
    """Steps of the reduce-scatter over every rank, then both residuals handed to another route
    (``compression="auto"`` switching codecs): into zeros, as this rank's values to be averaged over the world."""
    codec = new_codec("sparse", options)
    bucket = make_bucket([(numel,)])
    outs = []
    for step in range(data.shape[1]):
        outs.append(data[rank, step].clone())
        reduce(codec, outs[-1], bucket)
    folded = torch.zeros(numel)
    codec.fold_residual(0, folded, rank, world)
    return torch.stack(outs), folded, codec.states


def test_sparse_reduce_scatter_hands_both_residuals_over_when_the_route_changes(ranks):
    # What the outputs still owe the exact means reaches the next route's mean whole: the ranks' own residuals
    # and, n times on the owner's values of its range, the second ones.
    numel = 700  # (11 chunks of 64 over 4 ranks: ranges of 2, 3, 3 and 3, the last chunk short)
    data = inputs(3, numel, seed=22)
    results = ranks.run(fold_after_steps, SCATTERED, numel, data)
    outs = results[0][0]
    assert all(states == {} for _, _, states in results)
    handed = torch.stack([folded for _, folded, _ in results]).mean(0)
    torch.testing.assert_close(outs.sum(0) + handed, data.mean(0).sum(0), atol=1e-4, rtol=1e-4)
    assert (outs.sum(0) - data.mean(0).sum(0)).abs().max() > 1e-2


def switch_groups(rank, world, options, numel, data):
    """Two steps over every rank, then one over ranks 0 and 1 only (as when replica groups go): on ranks 0 and 1
    the last step's output and the state before and after it."""
    pair = dist.new_group([0, 1])
    codec = new_codec("sparse", options, TracedCommunicator(ranks_per_node=1))
    bucket = make_bucket([(numel,)])
    for step in range(2):
        reduce(codec, data[rank, step].clone(), bucket)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in codec.states[0].as_dict().items()}
    if rank > 1:
        return None
    tensor = data[rank, 2].clone()
    codec.on_cross_node_reduce(tensor=tensor, group=pair, bucket=bucket, offset=0).wait()
    return tensor, before, codec.states[0].as_dict()


@pytest.mark.parametrize("aggregation", ["reduce_scatter", "auto"])
def test_sparse_second_residual_of_a_range_no_longer_owned_reaches_the_next_mean(ranks, aggregation):
    # From 4 ranks to 2: rank 1 owned chunks 4-7 of 16 and now owns 8-15 ("auto" takes the all-gather on 2 ranks,
    # which keeps no second residual). The old second residuals reach the pair's mean through the old owners'
    # own values: its output, plus what the pair's residuals hold after it, is the pair's inputs and residuals
    # before it, plus those.
    numel = 16 * 64
    data = inputs(3, numel, seed=23)
    options = {**SCATTERED, "aggregation": aggregation}
    pair = [r for r in ranks.run(switch_groups, options, numel, data) if r is not None]
    assert torch.equal(pair[0][0], pair[1][0])
    befores, afters = [b for _, b, _ in pair], [a for _, _, a in pair]
    assert all((b["owner_rank"], b["owner_size"]) == (rank, 4) for rank, b in enumerate(befores))
    assert all(("owner_residual" in a) is (aggregation == "reduce_scatter") for a in afters)
    old = torch.zeros(numel)
    for rank, b in enumerate(befores):  # (ranks 2 and 3 are gone: theirs stay with them)
        old[rank * 4 * 64 : (rank + 1) * 4 * 64] = b["owner_residual"]
    came = sum(data[r, 2] + befores[r]["residual"][:numel] for r in range(2)) / 2 + old
    left = sum(a["residual"][:numel] for a in afters) / 2 + owed_by_owners(afters, numel, options, 2)
    assert old.abs().max() > 0.1
    torch.testing.assert_close(pair[0][0] + left, came, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------- PowerSGD


def test_powersgd_averages_exactly_before_start_iter(ranks):
    data = inputs(3, 64 * 64, seed=5)
    outs = ranks.run(reduce_steps, "powersgd", {"start_iter": 2, "error_feedback": False}, [(64, 64)], data)[0][0]
    means = data.mean(0)
    torch.testing.assert_close(outs[:2], means[:2])
    assert (outs[2] - means[2]).abs().max() > 0.1  # a full-rank random matrix is not rank 4


def test_powersgd_recovers_a_low_rank_mean_and_sends_vectors_uncompressed(ranks):
    g = torch.Generator().manual_seed(6)
    shared = torch.randn(2, 48, generator=g)
    matrices = torch.stack([torch.randn(32, 2, generator=g) @ shared for _ in range(WORLD)])  # mean has rank 2
    biases = torch.randn(WORLD, 48, generator=g)
    data = torch.cat([matrices.flatten(1), biases], dim=1)[:, None]
    out = ranks.run(reduce_steps, "powersgd", {"rank": 4, "start_iter": 0, "error_feedback": False},
                    [(32, 48), (48,)], data)[0][0][0]
    torch.testing.assert_close(out, data[:, 0].mean(0), atol=1e-4, rtol=1e-4)


def test_powersgd_min_compression_rate_sends_small_matrices_uncompressed(ranks):
    data = inputs(1, 16 * 16, seed=7)
    # 16 x 16 at rank 4: compression rate 256 / (4 * 32) = 2, below 3.
    out = ranks.run(reduce_steps, "powersgd", {"start_iter": 0, "min_compression_rate": 3.0}, [(16, 16)], data)[0][0][0]
    torch.testing.assert_close(out, data[:, 0].mean(0))


def test_powersgd_maps_a_shard_of_a_bucket_to_whole_rows_of_its_parameters():
    # Parameters (4 x 10) at 0, (10,) at 40, (6 x 5) at 50; the shard is bucket[25:55].
    shapes = [torch.Size((4, 10)), torch.Size((10,)), torch.Size((6, 5))]
    segments = matrix_segments(shapes, [0, 40, 50], start=25, length=30, rank=4, min_compression_rate=0.1)
    # Row 3 of the first matrix (bucket[30:40]) and row 0 of the last (bucket[50:55]); row 2 is cut by the shard.
    assert segments == [(5, 1, 10), (25, 1, 5)]


def test_powersgd_runs_many_buckets_one_after_another(ranks):
    results = ranks.run(many_buckets, 12)
    assert all(torch.equal(r, results[0]) for r in results)


def many_buckets(rank, world, count):
    codec = new_codec("powersgd", {"start_iter": 0, "rank": 2})
    outs = []
    for step in range(3):
        for index in range(count):
            bucket = make_bucket([(8 + index, 12)], index=index)
            tensor = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(rank * 1000 + step * 100 + index))
            reduce(codec, tensor, bucket)
            outs.append(tensor)
    return torch.cat(outs)


def powersgd_around_a_non_finite_step(rank, world, data):
    """Every step's output with and without warm start (a NaN at step 1 of 4), every rank's residual after the
    NaN step, the checkpoint saved then, and steps 2 and 3 of a codec resumed from it."""
    outs, residual, saved, resumed = {}, None, None, []
    for warm in (True, False):
        options = {"rank": 2, "start_iter": 0, "warm_start": warm}
        codec, bucket, steps = new_codec("powersgd", options), make_bucket([(24, 40), (40,)]), []
        for step in range(data.shape[1]):
            steps.append(data[rank, step].clone())
            reduce(codec, steps[-1], bucket)
            if warm and step == 1:
                residual = codec.states[0].residual.clone()
                saved = codec.on_save_state_dict(), codec.on_save_rank_state_dict()
                again = new_codec("powersgd", options)
                again.on_load_state_dict(state=saved[0], rank_state=saved[1])
        outs[warm] = torch.stack(steps)
    for step in (2, 3):
        resumed.append(data[rank, step].clone())
        reduce(again, resumed[-1], bucket)
    return outs, residual, saved[0], torch.stack(resumed)


def test_powersgd_draws_q_afresh_after_a_non_finite_step(ranks):
    # A NaN gradient leaves NaN in Q; warm start must not reuse it: the next step draws Q from the generator
    # seeded for that step, as a codec without warm start does (every residual was dropped, so the inputs of
    # the two codecs are the same then), and a checkpoint saved in between holds no Q.
    data = inputs(4, 24 * 40 + 40, seed=12)
    data[2, 1, 5] = float("nan")
    for outs, residual, saved, resumed in ranks.run(powersgd_around_a_non_finite_step, data):
        assert not torch.isfinite(outs[True][1]).all()
        assert torch.equal(residual, torch.zeros_like(residual))
        assert torch.equal(outs[True][2], outs[False][2])
        assert not torch.equal(outs[True][3], outs[False][3])  # (warm start is back at the step after)
        assert "q" not in saved["codec/powersgd"][0] and saved["codec/powersgd"][0]["iteration"] == 2
        assert torch.equal(resumed, outs[True][2:])


# ---------------------------------------------------------------------- error feedback and state


def pending(name, states, numel, options):
    """What error feedback still owes the mean: the mean of the ranks' residuals (plus int8's residuals of each
    rank's chunk of the mean)."""
    owed = torch.stack([s["residual"][:numel] for s in states]).mean(0)  # (sparse keeps it padded to its chunks)
    if name == "int8":
        owed = owed + torch.cat([s["chunk_residual"].flatten() for s in states])[:numel]
    return owed


@pytest.mark.parametrize(
    ("name", "options"),
    [("int8", {"block_size": 128}), ("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2, "start_iter": 0}),
     ("sparse", {"density": 0.05, "chunk": 100, "bits": 2})],
)
def test_error_feedback_carries_what_compression_left_out(ranks, name, options):
    # Summed over steps, outputs plus what the residuals still hold equal the exact means: nothing is lost.
    steps, shape = 6, (24, 40)
    data = inputs(steps, 24 * 40, seed=8)
    results = ranks.run(reduce_steps, name, options, [shape], data)
    outs, states = results[0][0], [r[1] for r in results]
    exact = data.mean(0).sum(0)
    sent = outs.sum(0)
    owed = pending(name, states, 24 * 40, options)
    assert (sent - exact).abs().max() > 1e-2  # compression did lose something this run...
    torch.testing.assert_close(sent + owed, exact, atol=1e-4, rtol=1e-4)  # ...and error feedback kept it


@pytest.mark.parametrize(
    ("name", "options"),
    [("int8", {"block_size": 128}), ("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2, "start_iter": 2}),
     ("sparse", {"density": 0.05, "chunk": 128, "bits": 4}),
     ("sparse", {"density": 0.05, "chunk": 32, "bits": 4, "aggregation": "reduce_scatter"})],
    ids=["int8", "topk", "powersgd", "sparse", "sparse-reduce_scatter"],
)
def test_codec_state_round_trips_through_a_checkpoint(ranks, name, options):
    results = ranks.run(resume_step, name, options, [(24, 40)], inputs(5, 24 * 40, seed=9))
    for rank, ((uninterrupted, resumed), saved) in enumerate(results):
        assert torch.equal(uninterrupted, resumed)
        # This rank's own state (the strategy collects every rank's: tests/test_compression_training.py).
        assert list(saved["rank"][f"codec/{name}"]) == [0]
        assert "residual" in saved["rank"][f"codec/{name}"][0]
        if options.get("aggregation") == "reduce_scatter":  # (the owner's second residual: its 8 chunks of the 30)
            mine = saved["rank"][f"codec/{name}"][0]
            assert mine["owner_residual"].shape == (8 * 32,) and (mine["owner_rank"], mine["owner_size"]) == (rank, WORLD)
            assert mine["owner_residual"].abs().max() > 0


def test_stateless_codecs_save_nothing():
    assert BUILTIN_CODECS["fp16"]().on_save_state_dict() is None


def test_resume_on_another_world_size_keeps_only_shared_state():
    codec = BUILTIN_CODECS["powersgd"]()
    saved = {"codec/powersgd": {"world_size": 8, "ranks": [
        {0: {"numel": 10, "iteration": 7, "q": torch.ones(3), "residual": torch.ones(10)}}] * 8}}
    codec.on_load_state_dict(state=saved, rank_state=None)  # this process is not distributed: world size 1
    assert set(codec.states[0].as_dict()) == {"iteration", "q"} and codec.states[0].numel == 10


def test_resume_without_this_ranks_state_keeps_only_shared_state():
    # The strategy hands no per-rank state when the checkpoint's world size differs from this run's.
    codec = BUILTIN_CODECS["powersgd"]()
    shared = {"codec/powersgd": {0: {"numel": 10, "iteration": 7, "q": torch.ones(3)}}}
    codec.on_load_state_dict(state=shared, rank_state=None)
    assert set(codec.states[0].as_dict()) == {"iteration", "q"} and codec.states[0].iteration == 7


# ---------------------------------------------------------------------- bad options fail at construction


@pytest.mark.parametrize(
    ("compression", "options", "pattern"),
    [
        ("powersgd", {"rank": 0}, r"`compression_options\['rank'\]=0`.*'powersgd'.*allowed values: a positive integer"),
        ("powersgd", {"rank": -2}, r"compression_options\['rank'\]=-2"),
        ("powersgd", {"rank": 2.5}, r"compression_options\['rank'\]=2.5"),
        ("powersgd", {"start_iter": -1}, r"compression_options\['start_iter'\]=-1.*integer >= 0"),
        ("powersgd", {"min_compression_rate": 0}, r"compression_options\['min_compression_rate'\]=0.*> 0"),
        ("powersgd", {"epsilon": -1e-8}, r"compression_options\['epsilon'\].*>= 0"),
        ("powersgd", {"warm_start": "yes"}, r"compression_options\['warm_start'\]='yes'.*True, False"),
        ("topk", {"ratio": 0}, r"compression_options\['ratio'\]=0`.*'topk'.*allowed values: a number in \(0, 1\]"),
        ("topk", {"ratio": 1.5}, r"compression_options\['ratio'\]=1.5"),
        ("topk", {"ratio": float("nan")}, r"compression_options\['ratio'\]=nan"),
        ("int8", {"block_size": 0}, r"compression_options\['block_size'\]=0`.*'int8'.*allowed values: a positive integer"),
        ("int8", {"block_size": -256}, r"compression_options\['block_size'\]=-256"),
        ("int8", {"blocksize": 256}, r"`compression_options\['blocksize'\]` is not an option of `compression='int8'`;"
                                     r" accepted options: 'block_size', 'error_feedback'"),
        ("sparse", {"density": 0}, r"compression_options\['density'\]=0`.*'sparse'.*allowed values: a number in \(0, 1\]"),
        ("sparse", {"bits": 3}, r"compression_options\['bits'\]=3`.*'sparse'.*allowed values: 2, 4 or 8"),
        ("sparse", {"chunk": 1}, r"compression_options\['chunk'\]=1`.*an integer from 2 to 65536"),
        ("sparse", {"chunk": 70000}, r"compression_options\['chunk'\]=70000"),
        ("sparse", {"decay": 1.5}, r"compression_options\['decay'\]=1.5`.*a number in \[0, 1\]"),
        ("sparse", {"decay": 0.9, "error_feedback": False}, r"compression_options\['decay'\]=0.9` decays.*error_feedback"),
        ("sparse", {"aggregation": "ring"}, (r"`compression_options\['aggregation'\]='ring'` is not valid for"
                                             r" `compression='sparse'`; allowed values: 'all_gather', 'reduce_scatter',"
                                             r" 'auto'")),
        ("sparse", {"warmup_syncs": -1}, r"compression_options\['warmup_syncs'\]=-1`.*'sparse'.*an integer >= 0"),
        ("sparse", {"warmup_syncs": 2.0}, r"compression_options\['warmup_syncs'\]=2.0`.*an integer >= 0"),
        ("sparse", {"aggregation": None}, r"compression_options\['aggregation'\]=None`.*'all_gather', 'reduce_scatter'"),
        ("fp16", {"rank": 4}, r"compression_options\['rank'\]` is not an option of `compression='fp16'`;"
                              r" accepted options: none"),
    ],
)
def test_bad_codec_option_fails_at_construction(compression, options, pattern):
    with pytest.raises(ValueError, match=pattern):
        HierarchicalZeroStrategy(compression=compression, compression_options=options)


def test_unknown_codec_message_lists_the_built_in_codecs():
    with pytest.raises(ValueError, match=r"`compression='fp8'`.*allowed values: None, .*'fp16', 'bf16', 'int8', 'topk',"
                                         r" 'powersgd'"):
        HierarchicalZeroStrategy(compression="fp8")


def test_good_options_are_kept():
    strategy = HierarchicalZeroStrategy(compression="powersgd", compression_options={"rank": 2, "start_iter": 5})
    assert strategy.compression_options == {"rank": 2, "start_iter": 5}
