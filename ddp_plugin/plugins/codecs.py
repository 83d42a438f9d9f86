"""Gradient codecs: plugins that answer ``on_cross_node_reduce`` with fewer bytes than a float32 all-reduce.

Select one with ``HierarchicalZeroStrategy(compression=NAME, compression_options={...})``; the options are
this module's constructor keyword arguments, checked when the strategy is constructed.

| name       | class           | bytes on the wire (fp32 = 1)                     | error feedback |
| ---------- | --------------- | ------------------------------------------------ | -------------- |
| ``fp16``   | ``Fp16Codec``   | 1/2, one all-reduce                              | no             |
| ``bf16``   | ``Bf16Codec``   | 1/2, one all-reduce                              | no             |
| ``int8``   | ``Int8Codec``   | about 1/4: all-to-all + all-gather of int8       | yes, two-sided |
| ``topk``   | ``TopKCodec``   | n * ratio: all-gather of values + int32 indices  | yes            |
| ``powersgd`` | ``PowerSGDCodec`` | r(m+n)/(mn) per matrix, two all-reduces      | yes            |

Every codec leaves the same bits on every rank of the group (C1): whatever is decoded is decoded from the same
gathered data in the same order everywhere.

Per-bucket state (error-feedback residuals, PowerSGD's Q matrices and iteration counts) lives in the codec,
keyed by ``bucket.index``; for a given bucket the reducer always passes a tensor of the same size (the whole
bucket with the flat reducer, this rank's shard with the hierarchical one). It is declared for checkpoints
through ``on_save_state_dict``/``on_load_state_dict`` under the key ``codec/<name>``. Residuals differ from
rank to rank, so saving gathers every rank's state (a small object all-gather on the default group; every
rank calls ``on_save_state_dict`` because Lightning's ``save_checkpoint`` runs on every rank) and loading picks
this rank's. Resumed on another world size, the per-rank residuals are dropped (a warning says so) and shared
state (PowerSGD's Q and iteration count) is kept where its shape still fits.

All collectives go through :mod:`ddp_plugin.collectives`, so the traffic accounting sees the compressed bytes.
Several dependent collectives per bucket are issued and waited for on the engine's communication thread,
never from a future's callback (the hook contract's threading rule), which is why PowerSGD here runs on gloo
with any number of buckets.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from ddp_plugin import collectives
from ddp_plugin.hookspecs import completed_future, hookimpl

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.hookspecs import Bucket, Topology

log = logging.getLogger(__name__)

INT8_MAX = 127


# ---------------------------------------------------------------------- option validation


def _option_error(codec: str, option: str, value: Any, allowed: str) -> ValueError:
    return ValueError(
        f"`compression_options[{option!r}]={value!r}` is not valid for `compression={codec!r}`; allowed values:"
        f" {allowed}."
    )


def _positive_int(codec: str, option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _option_error(codec, option, value, "a positive integer")
    return value


def _non_negative_int(codec: str, option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _option_error(codec, option, value, "an integer >= 0")
    return value


def _number(codec: str, option: str, value: Any, allowed: str, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise _option_error(codec, option, value, allowed)
    return float(value)


def _flag(codec: str, option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _option_error(codec, option, value, "True, False")
    return value


# ---------------------------------------------------------------------- the common part


class Codec:
    """What every built-in codec shares: options checked at construction, per-bucket state, checkpoint hooks,
    and the one-rank shortcut (a group of one rank already holds its mean: nothing is sent or compressed).

    Subclasses set ``name`` and ``defaults`` (the accepted options and their default values), validate the
    values in ``__init__`` and implement :meth:`reduce`."""

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    shared_state: ClassVar[tuple[str, ...]] = ()
    """State keys that are the same on every rank and survive a resume on another world size."""

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            accepted = ", ".join(repr(k) for k in self.defaults) or "none"
            raise ValueError(
                f"`compression_options[{unknown[0]!r}]` is not an option of `compression={self.name!r}`;"
                f" accepted options: {accepted}."
            )
        self.options = {**self.defaults, **options}
        self._state: dict[int, dict[str, Any]] = {}
        self.topology: Topology | None = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({args})"

    @hookimpl
    def on_setup(self, topology: Topology) -> None:
        self.topology = topology

    @hookimpl
    def on_cross_node_reduce(self, tensor: Tensor, group: dist.ProcessGroup, bucket: Bucket) -> torch.futures.Future:
        n = dist.get_world_size(group)
        if n == 1:
            return completed_future(tensor)
        return self.reduce(tensor, group, n, bucket, self.bucket_state(bucket.index, tensor))

    def reduce(
        self, tensor: Tensor, group: dist.ProcessGroup, n: int, bucket: Bucket, state: dict[str, Any]
    ) -> torch.futures.Future:
        """Write the mean of ``tensor`` over the ``n`` ranks of ``group`` into it, in place."""
        raise NotImplementedError

    # -------------------------------------------------------------- state

    def bucket_state(self, index: int, tensor: Tensor) -> dict[str, Any]:
        """This bucket's state, on ``tensor``'s device; reset if it was saved for a tensor of another size."""
        state = self._state.setdefault(index, {})
        if state.get("numel", tensor.numel()) != tensor.numel():
            log.warning(
                "ddp_plugin %s codec: state of bucket %d was saved for %d values, the bucket now has %d;"
                " starting that bucket afresh.", self.name, index, state["numel"], tensor.numel()
            )
            state.clear()
        state["numel"] = tensor.numel()
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != tensor.device:
                state[key] = value.to(tensor.device)
        return state

    @hookimpl
    def on_save_state_dict(self) -> dict[str, Any] | None:
        if not self.shared_state and not self._stateful():
            return None
        local = {
            index: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
            for index, state in self._state.items()
        }
        ranks = _gather_objects(local)
        return {f"codec/{self.name}": {"world_size": len(ranks), "ranks": ranks}}

    @hookimpl
    def on_load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get(f"codec/{self.name}")
        if saved is None:
            return
        world, rank = _world()
        ranks = saved["ranks"]
        if saved["world_size"] == world:
            mine = ranks[rank]
        else:
            log.warning(
                "ddp_plugin %s codec: the checkpoint was saved by %d ranks, this run has %d; per-rank state"
                " (error-feedback residuals) starts from zero, shared state (%s) is kept.",
                self.name, saved["world_size"], world, ", ".join(self.shared_state) or "none",
            )
            mine = {i: {k: v for k, v in s.items() if k in (*self.shared_state, "numel")} for i, s in ranks[0].items()}
        self._state = {int(i): dict(s) for i, s in mine.items()}

    def _stateful(self) -> bool:
        return bool(self.options.get("error_feedback"))


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (checkpoint bookkeeping, not gradient traffic: not accounted)."""
    world, _ = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _padded_copy(tensor: Tensor, length: int) -> Tensor:
    out = tensor.new_zeros(length)
    out[: tensor.numel()].copy_(tensor)
    return out


# ---------------------------------------------------------------------- fp16 / bf16


class _CastCodec(Codec):
    dtype: ClassVar[torch.dtype]

    def reduce(self, tensor, group, n, bucket, state):
        # Divide before casting and summing (as torch's fp16 hook): the sum of n values each below
        # fp16's maximum (65504) / n stays finite, where summing first could overflow.
        low = torch.div(tensor, n).to(self.dtype)
        fut = collectives.all_reduce(low, group=group, async_op=True).get_future()

        def decompress(_: torch.futures.Future) -> Tensor:
            # A local copy, no collective: allowed in a callback.
            tensor.copy_(low)
            return tensor

        return fut.then(decompress)


class Fp16Codec(_CastCodec):
    """Cast to float16 after dividing by the group size, all-reduce, cast back in place. Half the bytes of a
    float32 all-reduce; about 3 significant digits, range 6e-8 (subnormal) to 65504. No options."""

    name = "fp16"
    dtype = torch.float16


class Bf16Codec(_CastCodec):
    """Like :class:`Fp16Codec` with bfloat16: float32's range (no overflow, no underflow of small gradients)
    with about 2-3 significant digits. No options."""

    name = "bf16"
    dtype = torch.bfloat16


# ---------------------------------------------------------------------- int8


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of ``x`` (one block each) to int8 with one float32 scale per row: ``q = round(x / s)``,
    ``s = max|row| / 127``; the rounding error is at most ``s / 2`` per value."""
    scales = x.abs().amax(dim=1) / INT8_MAX
    # An all-zero block has scale 0; divide by the smallest normal float instead (q stays 0).
    q = torch.round(x / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales.float()


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return q.to(dtype) * scales.to(dtype).unsqueeze(-1)


class Int8Codec(Codec):
    """Block-wise int8 quantization, reduced in two shots (the traffic of an all-reduce, at a quarter of the
    bytes):

    1. each rank adds its residual, splits the tensor into n chunks of blocks of at most ``block_size`` values,
       quantizes every block with its own scale, and sends chunk j to rank j (all-to-all of int8 + scales);
    2. rank j dequantizes the n versions of its chunk, averages them in rank order, adds its second residual,
       quantizes the mean again, and all-gathers it (int8 + scales); every rank dequantizes the same bytes.

    Integers are never summed by a collective (they would overflow and carry no scale). Bytes per rank:
    2(n-1)/n * (S/4 + S/block_size) against 2(n-1)/n * S for float32 (S: bytes of the tensor).

    Error feedback on both quantizations (as DeepSpeed's compressed all-reduce): what rounding took from this
    rank's input (``residual``) and from this rank's chunk of the mean (``chunk_residual``) is added back the
    next step, so no gradient is lost for good, only delayed.

    Options: ``block_size`` (default 1024, values per scale; more values per scale, fewer scale bytes but
    coarser steps), ``error_feedback`` (default True).
    """

    name = "int8"
    defaults: ClassVar[dict[str, Any]] = {"block_size": 1024, "error_feedback": True}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.block_size = _positive_int(self.name, "block_size", self.options["block_size"])
        self.error_feedback = _flag(self.name, "error_feedback", self.options["error_feedback"])

    def layout(self, numel: int, n: int) -> tuple[int, int]:
        """(blocks per chunk, values per block): n equal chunks of equal blocks of at most ``block_size``,
        balanced so that padding stays below one value per block."""
        chunk = -(-numel // n)
        blocks = -(-chunk // self.block_size)
        return blocks, -(-chunk // blocks)

    def reduce(self, tensor, group, n, bucket, state):
        numel = tensor.numel()
        blocks, width = self.layout(numel, n)
        x = _padded_copy(tensor, n * blocks * width).float()
        if self.error_feedback and "residual" in state:
            x[:numel] += state["residual"]
        x = x.view(n * blocks, width)
        q, scales = quantize_int8(x)
        if self.error_feedback:
            state["residual"] = _finite_or_zero((x - dequantize_int8(q, scales)).view(-1)[:numel])

        # Shot 1: chunk j (blocks j*blocks ... ) to rank j.
        q_in, s_in = torch.empty_like(q), torch.empty_like(scales)
        works = [
            collectives.all_to_all_single(q_in, q, group=group, async_op=True),
            collectives.all_to_all_single(s_in, scales, group=group, async_op=True),
        ]
        for work in works:
            work.wait()
        chunk = dequantize_int8(q_in.view(n, blocks, width), s_in.view(n, blocks)).sum(dim=0).div_(n)
        if self.error_feedback and "chunk_residual" in state:
            chunk += state["chunk_residual"]
        q2, s2 = quantize_int8(chunk)
        if self.error_feedback:
            state["chunk_residual"] = _finite_or_zero(chunk - dequantize_int8(q2, s2))

        # Shot 2: everyone gets every rank's quantized chunk of the mean.
        q_all = q2.new_empty(n * blocks, width)
        s_all = s2.new_empty(n * blocks)
        works = [
            collectives.all_gather_single(q_all, q2, group=group, async_op=True),
            collectives.all_gather_single(s_all, s2, group=group, async_op=True),
        ]
        for work in works:
            work.wait()
        tensor.copy_(dequantize_int8(q_all, s_all).view(-1)[:numel])
        return completed_future(tensor)


def _finite_or_zero(residual: Tensor) -> Tensor:
    """A non-finite gradient (an fp16 loss-scale overflow the optimizer will skip) must not poison every later
    step through the residual: drop the residual then. The non-finite values themselves still reach the
    output, so the overflow check after backward sees them."""
    if not torch.isfinite(residual).all():
        return torch.zeros_like(residual)
    return residual


# ---------------------------------------------------------------------- top-k


class TopKCodec(Codec):
    """Keep the ``ratio`` of values with the largest magnitude (after adding the residual), all-gather their
    values (float32) and indices (int32), and average locally: every rank scatters rank 0's, then rank 1's, ...
    entries into zeros and divides by n, so the float additions happen in the same order everywhere.

    Bytes per rank: (n-1) * 8 * k for k = ceil(ratio * numel) kept values (a float32 all-reduce sends
    2(n-1)/n * 4 * numel): worthwhile for small ratios and groups, which the cross-node group is.

    Error feedback: what was not sent (everything but the top k) is added to the next step's input, so small
    gradients accumulate until they are sent.

    Options: ``ratio`` (default 0.01; in (0, 1]), ``error_feedback`` (default True).
    """

    name = "topk"
    defaults: ClassVar[dict[str, Any]] = {"ratio": 0.01, "error_feedback": True}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.ratio = _number(self.name, "ratio", self.options["ratio"], "a number in (0, 1]", lambda r: 0 < r <= 1)
        self.error_feedback = _flag(self.name, "error_feedback", self.options["error_feedback"])

    def kept(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def reduce(self, tensor, group, n, bucket, state):
        numel = tensor.numel()
        k = self.kept(numel)
        x = tensor.float()  # the tensor itself when it is float32: only read unless error feedback copies it
        if self.error_feedback:
            x = x + state["residual"] if "residual" in state else x.clone()
        indices = x.abs().topk(k, sorted=False).indices
        values = x[indices]
        if self.error_feedback:
            x[indices] = 0
            state["residual"] = _finite_or_zero(x)
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        all_values = values.new_empty(n * k)
        all_indices = indices.new_empty(n * k, dtype=index_dtype)
        works = [
            collectives.all_gather_single(all_values, values, group=group, async_op=True),
            collectives.all_gather_single(all_indices, indices.to(index_dtype), group=group, async_op=True),
        ]
        for work in works:
            work.wait()
        out = torch.zeros(numel, dtype=torch.float32, device=tensor.device)
        # One rank's indices are distinct, so each index_add_ touches every slot at most once: the result does
        # not depend on the order of atomic adds (CUDA), only on the rank order, which is fixed.
        for r in range(n):
            out.index_add_(0, all_indices[r * k : (r + 1) * k].long(), all_values[r * k : (r + 1) * k])
        tensor.copy_(out.div_(n))
        return completed_future(tensor)


# ---------------------------------------------------------------------- PowerSGD


def matrix_segments(
    shapes: list[torch.Size], offsets: list[int], start: int, length: int, rank: int, min_compression_rate: float
) -> list[tuple[int, int, int]]:
    """The parts of ``tensor = bucket[start : start + length]`` that PowerSGD compresses, as
    ``(offset in tensor, rows, cols)``: for each parameter of two or more dimensions (viewed as
    ``shape[0] x rest``, as torch's hook does), the whole rows of it that lie inside the tensor, when
    ``rows * cols / (r * (rows + cols)) >= min_compression_rate`` with ``r = min(rank, rows, cols)``.
    Everything else (biases, norms, small matrices, rows cut by a shard boundary) is sent uncompressed."""
    segments = []
    end = start + length
    for shape, offset in zip(shapes, offsets):
        if len(shape) < 2:
            continue
        rows_total = shape[0]
        cols = math.prod(shape[1:])
        if rows_total == 0 or cols == 0:
            continue
        lo, hi = max(start, offset), min(end, offset + rows_total * cols)
        if hi <= lo:
            continue
        first = -(-(lo - offset) // cols)
        last = (hi - offset) // cols
        rows = last - first
        if rows <= 0:
            continue
        r = min(rank, rows, cols)
        if rows * cols / (r * (rows + cols)) < min_compression_rate:
            continue
        segments.append((offset + first * cols - start, rows, cols))
    return segments


def orthogonalize(m: Tensor, epsilon: float) -> None:
    """Orthonormalize the columns of ``m`` in place: a QR factorization when ``epsilon == 0`` (as torch's hook;
    columns stay orthonormal even when P is rank-deficient, e.g. a gradient of lower rank than ``rank``), else
    Gram-Schmidt with ``epsilon`` added to each norm (a zero column stays zero instead of becoming NaN, but a
    nearly dependent column is amplified from rounding noise)."""
    if epsilon == 0:
        m.copy_(torch.linalg.qr(m).Q)
        return
    for i in range(m.shape[1]):
        col = m[:, i : i + 1]
        col.div_(col.norm() + epsilon)
        if i + 1 < m.shape[1]:
            rest = m[:, i + 1 :]
            rest.sub_(col * (col * rest).sum(dim=0, keepdim=True))


class PowerSGDCodec(Codec):
    """PowerSGD (Vogels et al., 2019): each gradient matrix M (m x n, summed with its residual) is replaced by a
    rank-r approximation P Q^T found by one step of power iteration, with two all-reduces:

        P = M Q        all-reduce P (sum), orthonormalize its columns
        Q = M^T P      all-reduce Q, divide by the group size;  mean(M) ~ P Q^T

    Bytes per matrix: r(m + n) values in two all-reduces instead of mn. P is identical on all ranks after the
    first all-reduce and the orthonormalization is deterministic, so every rank ends with the same bits.

    Which matrices: a bucket is flat, so the codec views each parameter of 2+ dimensions in it as
    ``shape[0] x rest`` (torch's hook does the same per tensor). With the flat reducer the tensor is the whole
    bucket; with the hierarchical reducer it is this rank's 1/k chunk of the bucket (chunk ``local_rank`` of
    ``ceil(numel / k)`` values, as :class:`~ddp_plugin.plugins.HierarchicalReducer` documents), and the whole
    rows of each parameter inside the chunk form its matrix. Matrices whose compression rate
    ``mn / (r(m+n))`` is below ``min_compression_rate``, and every 1-D parameter, travel uncompressed in one
    averaging all-reduce issued first, so it overlaps the matrix products. A tensor the codec cannot map to
    parameters is viewed as one near-square matrix.

    Before ``start_iter`` steps (counted per bucket) the bucket is averaged exactly, without compression: the
    first steps move the parameters the most and are where compression hurts. With ``warm_start`` the last
    step's Q seeds the next power iteration (better approximations over time); without it Q is drawn afresh
    each step from a generator seeded identically on every rank.

    Error feedback: residual = (M + residual) - P Q^T, the local matrix minus the averaged approximation, as in
    the paper and torch's hook; uncompressed parts are exact and leave no residual.

    Waiting between the two all-reduces happens on the communication thread, never in a future callback, so
    it works on gloo with any number of buckets (torch's hook aborts there with more than one).

    Options: ``rank`` (default 4), ``start_iter`` (default 10), ``min_compression_rate`` (default 2.0),
    ``epsilon`` (default 0: a QR factorization, robust when P has dependent columns; > 0: Gram-Schmidt with
    epsilon added to each column norm, cheaper for large ranks), ``warm_start`` (default True), ``error_feedback``
    (default True), ``seed`` (default 0).
    """

    name = "powersgd"
    defaults: ClassVar[dict[str, Any]] = {
        "rank": 4,
        "start_iter": 10,
        "min_compression_rate": 2.0,
        "epsilon": 0.0,
        "warm_start": True,
        "error_feedback": True,
        "seed": 0,
    }
    shared_state = ("iteration", "q")

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.rank = _positive_int(self.name, "rank", self.options["rank"])
        self.start_iter = _non_negative_int(self.name, "start_iter", self.options["start_iter"])
        self.min_compression_rate = _number(
            self.name, "min_compression_rate", self.options["min_compression_rate"], "a number > 0", lambda v: v > 0
        )
        self.epsilon = _number(self.name, "epsilon", self.options["epsilon"], "a number >= 0", lambda v: v >= 0)
        self.warm_start = _flag(self.name, "warm_start", self.options["warm_start"])
        self.error_feedback = _flag(self.name, "error_feedback", self.options["error_feedback"])
        seed = self.options["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise _option_error(self.name, "seed", seed, "an integer")
        self.seed = seed
        self._segments: dict[int, list[tuple[int, int, int]]] = {}
        self._rest: dict[int, Tensor] = {}  # per bucket: True where values travel uncompressed

    def _stateful(self) -> bool:
        return True

    def segments(self, tensor: Tensor, bucket: Bucket) -> list[tuple[int, int, int]]:
        """The compressed matrices of this bucket's tensor, as ``(offset, rows, cols)``, sorted by offset."""
        found = self._segments.get(bucket.index)
        if found is not None:
            return found
        length = tensor.numel()
        start = self._start_in_bucket(length, bucket)
        if start is None:
            cols = max(1, math.isqrt(length))
            shapes, offsets, start = [torch.Size((length // cols, cols))], [0], 0
        else:
            shapes, offsets = [p.shape for p in bucket.params], list(bucket.offsets)
        found = self._segments[bucket.index] = matrix_segments(
            shapes, offsets, start, length, self.rank, self.min_compression_rate
        )
        return found

    def _start_in_bucket(self, length: int, bucket: Bucket) -> int | None:
        if length == bucket.numel:
            return 0
        t = self.topology
        if t is not None and t.num_nodes > 1 and t.ranks_per_node > 1:
            chunk = -(-bucket.numel // t.ranks_per_node)
            if length == chunk:
                return t.local_rank * chunk
        return None

    def reduce(self, tensor, group, n, bucket, state):
        iteration = state.get("iteration", 0)
        state["iteration"] = iteration + 1
        if iteration < self.start_iter:
            tensor.div_(n)
            return collectives.all_reduce(tensor, group=group, async_op=True).get_future()

        segments = self.segments(tensor, bucket)
        x = tensor
        if self.error_feedback:
            x = tensor + state["residual"] if "residual" in state else tensor.clone()

        # The uncompressed rest first, averaged exactly; it travels while the matrix products run.
        rest = self._rest.get(bucket.index)
        if rest is None or rest.device != tensor.device:
            rest = torch.ones(tensor.numel(), dtype=torch.bool, device=tensor.device)
            for offset, rows, cols in segments:
                rest[offset : offset + rows * cols] = False
            self._rest[bucket.index] = rest
        rest_values = x[rest].div_(n)
        rest_work = collectives.all_reduce(rest_values, group=group, async_op=True)

        if segments:
            ranks = [min(self.rank, rows, cols) for _, rows, cols in segments]
            matrices = [x[o : o + rows * cols].view(rows, cols) for o, rows, cols in segments]
            q_numel = sum(cols * r for (_, _, cols), r in zip(segments, ranks))
            p_numel = sum(rows * r for (_, rows, _), r in zip(segments, ranks))
            q_flat = state.get("q") if self.warm_start else None
            if q_flat is None or q_flat.numel() != q_numel:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket.index * 1009 + iteration)
                q_flat = torch.randn(q_numel, generator=g).to(device=tensor.device, dtype=x.dtype)
            p_flat = x.new_empty(p_numel)
            ps, qs = _views(p_flat, [(rows, r) for (_, rows, _), r in zip(segments, ranks)]), _views(
                q_flat, [(cols, r) for (_, _, cols), r in zip(segments, ranks)]
            )
            for m, p, q in zip(matrices, ps, qs):
                torch.matmul(m, q, out=p)
            collectives.all_reduce(p_flat, group=group, async_op=True).wait()
            for p in ps:
                orthogonalize(p, self.epsilon)
            for m, p, q in zip(matrices, ps, qs):
                torch.matmul(m.t(), p, out=q)
            collectives.all_reduce(q_flat, group=group, async_op=True).wait()
            q_flat.div_(n)
            # Warm start reuses Q; a non-finite gradient would otherwise leave NaN in every later step.
            if torch.isfinite(q_flat).all():
                state["q"] = q_flat
            else:
                state.pop("q", None)
            # Decompress in place (M is no longer needed): the tensor's matrices become P Q^T.
            for (o, rows, cols), p, q in zip(segments, ps, qs):
                torch.matmul(p, q.t(), out=tensor[o : o + rows * cols].view(rows, cols))

        rest_work.wait()
        tensor[rest] = rest_values
        if self.error_feedback:
            residual = x.sub_(tensor)  # x is a private copy here
            residual[rest] = 0
            state["residual"] = _finite_or_zero(residual)
        return completed_future(tensor)


def _views(flat: Tensor, shapes: list[tuple[int, int]]) -> list[Tensor]:
    views, offset = [], 0
    for rows, cols in shapes:
        views.append(flat[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return views


BUILTIN_CODECS: dict[str, type[Codec]] = {
    codec.name: codec for codec in (Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, PowerSGDCodec)
}
"""``compression=`` name -> codec class, in the order the error messages list them."""
