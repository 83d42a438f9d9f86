"""PowerSGD: a rank-r approximation of each gradient matrix by one step of power iteration."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ddp_plugin.runtime.checks import check_bool, check_int, check_number
from ddp_plugin.codecs.base import BucketState, Codec
from ddp_plugin.codecs.int8 import finite_or_zero
from ddp_plugin.runtime.finite import finite_flag
from ddp_plugin.hookspecs import completed_future, local_tensor

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.hookspecs import Bucket


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


class PowerSGDState(BucketState):
    shared = ("iteration", "q")
    per_rank = ("residual",)

    def __init__(self, numel: int) -> None:
        super().__init__(numel)
        # Derived from the bucket's layout, never saved: they live and die with the state, which starts afresh
        # when the bucket's size changes (a layout kept apart from it met the next size's tensor).
        self.segments: list[tuple[int, int, int]] | None = None
        self.rest: Tensor | None = None
        """Where values travel uncompressed: their positions in the tensor, ascending, on its device (gathered
        and scattered with ``index_select``/``index_copy_``; a boolean mask would make the host wait for the
        device to count it, every step)."""
        self.q_finite: Tensor | None = None
        """Whether ``q`` is finite, as a 0-dim bool tensor on its device (None: it is, as one drawn or loaded):
        a non-finite gradient leaves a non-finite Q, which the next step replaces by one drawn afresh, decided
        on the device (see :meth:`PowerSGDCodec.initial_q`)."""

    def state_dict(self) -> dict[str, Any]:
        """As saved before ``q_finite`` existed: a non-finite Q is left out (a resumed run draws one afresh)."""
        state = super().state_dict()
        if self.q_finite is not None and not self.q_finite:  # (a save waits for the device anyway: a copy)
            state.pop("q", None)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.q_finite = None

    def to(self, device: torch.device) -> None:
        super().to(device)
        if self.q_finite is not None and self.q_finite.device != device:
            self.q_finite = self.q_finite.to(device)


class PowerSGDCodec(Codec):
    """PowerSGD (Vogels et al., 2019): each gradient matrix M (m x n, summed with its residual) is replaced by a
    rank-r approximation P Q^T found by one step of power iteration, with two all-reduces:

        P = M Q        all-reduce P (sum), orthonormalize its columns
        Q = M^T P      all-reduce Q, divide by the group size;  mean(M) ~ P Q^T

    Bytes per matrix: r(m + n) values in two all-reduces instead of mn. P is identical on all ranks after the
    first all-reduce and the orthonormalization is deterministic, so every rank ends with the same bits.

    Which matrices: a bucket is flat, so the codec views each parameter of 2+ dimensions in it as
    ``shape[0] x rest`` (torch's hook does the same per tensor). The tensor it is handed is the part of the
    bucket from ``offset`` on (the whole bucket with the flat reducer, this rank's 1/k with the hierarchical
    one), and the whole rows of each parameter inside it form its matrix. Matrices whose compression rate
    ``mn / (r(m+n))`` is below ``min_compression_rate``, and every 1-D parameter, travel uncompressed in one
    averaging all-reduce issued first, so it overlaps the matrix products. A bucket without parameters is
    viewed as one near-square matrix.

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
    State = PowerSGDState

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.rank, self.start_iter, self.seed = o["rank"], o["start_iter"], o["seed"]
        self.min_compression_rate, self.epsilon = float(o["min_compression_rate"]), float(o["epsilon"])
        self.warm_start, self.error_feedback = o["warm_start"], o["error_feedback"]

    @classmethod
    def check_values(cls, o: dict[str, Any]) -> None:
        ctx, name = cls.context(), "compression_options[{!r}]".format
        check_int(name("rank"), o["rank"], minimum=1, context=ctx)
        check_int(name("start_iter"), o["start_iter"], minimum=0, context=ctx)
        check_number(name("min_compression_rate"), o["min_compression_rate"], minimum=0, expected="a number > 0",
                     context=ctx)
        check_number(name("epsilon"), o["epsilon"], minimum=0, strict=False, expected="a number >= 0", context=ctx)
        check_bool(name("warm_start"), o["warm_start"], context=ctx)
        check_bool(name("error_feedback"), o["error_feedback"], context=ctx)
        check_int(name("seed"), o["seed"], expected="an integer", context=ctx)

    @property
    def keeps_rank_state(self) -> bool:
        return self.error_feedback

    def segments(self, tensor: Tensor, bucket: Bucket, offset: int, state: PowerSGDState
                 ) -> list[tuple[int, int, int]]:
        """The compressed matrices of this bucket's tensor, as ``(offset, rows, cols)``, sorted by offset."""
        if state.segments is not None:
            return state.segments
        length = tensor.numel()
        if bucket.params:
            # (a tensor-parallel parameter's local shard: that is what the bucket holds)
            shapes, offsets, start = [local_tensor(p).shape for p in bucket.params], list(bucket.offsets), offset
        else:
            cols = max(1, math.isqrt(length))
            shapes, offsets, start = [torch.Size((length // cols, cols))], [0], 0
        state.segments = matrix_segments(shapes, offsets, start, length, self.rank, self.min_compression_rate)
        return state.segments

    def reduce(self, tensor, group, n, bucket, offset, state):
        iteration = state.iteration or 0
        state.iteration = iteration + 1
        if iteration < self.start_iter:
            tensor.div_(n)
            return self.comm.all_reduce(tensor, group=group, async_op=True).get_future()

        segments = self.segments(tensor, bucket, offset, state)
        x = tensor
        if self.error_feedback:
            # x = gradient + residual, in the residual's own memory (it becomes the next residual below): no
            # bucket-sized tensor is allocated per step.
            residual = state.residual
            usable = residual is not None and residual.shape == tensor.shape and residual.device == tensor.device
            x = residual.add_(tensor) if usable else tensor.clone()

        # The uncompressed rest first, averaged exactly; it travels while the matrix products run.
        rest = state.rest
        if rest is None or rest.device != tensor.device:
            rest = state.rest = rest_positions(segments, tensor.numel(), tensor.device)
        rest_values = x.index_select(0, rest).div_(n)
        rest_work = self.comm.all_reduce(rest_values, group=group, async_op=True)

        if segments:
            ranks = [min(self.rank, rows, cols) for _, rows, cols in segments]
            matrices = [x[o : o + rows * cols].view(rows, cols) for o, rows, cols in segments]
            q_numel = sum(cols * r for (_, _, cols), r in zip(segments, ranks))
            p_numel = sum(rows * r for (_, rows, _), r in zip(segments, ranks))
            q_flat = self.initial_q(state, q_numel, bucket, iteration, x)
            p_flat = x.new_empty(p_numel)
            ps = _views(p_flat, [(rows, r) for (_, rows, _), r in zip(segments, ranks)])
            qs = _views(q_flat, [(cols, r) for (_, _, cols), r in zip(segments, ranks)])
            for m, p, q in zip(matrices, ps, qs):
                torch.matmul(m, q, out=p)
            self.comm.all_reduce(p_flat, group=group, async_op=True).wait()
            for p in ps:
                orthogonalize(p, self.epsilon)
            for m, p, q in zip(matrices, ps, qs):
                torch.matmul(m.t(), p, out=q)
            self.comm.all_reduce(q_flat, group=group, async_op=True).wait()
            q_flat.div_(n)
            # Warm start reuses Q; a non-finite gradient would otherwise leave NaN in every later step: the next
            # step replaces a non-finite Q (initial_q), and the host never waits to learn whether it was.
            state.q, state.q_finite = q_flat, finite_flag(q_flat)
            # Decompress in place (M is no longer needed): the tensor's matrices become P Q^T.
            for (o, rows, cols), p, q in zip(segments, ps, qs):
                torch.matmul(p, q.t(), out=tensor[o : o + rows * cols].view(rows, cols))

        rest_work.wait()
        tensor.index_copy_(0, rest, rest_values)
        if self.error_feedback:
            residual = x.sub_(tensor)  # x is the residual's memory or a private copy here
            residual.index_fill_(0, rest, 0)
            state.residual = finite_or_zero(residual)
        return completed_future(tensor)

    def initial_q(self, state: PowerSGDState, numel: int, bucket: Bucket, iteration: int, like: Tensor) -> Tensor:
        """This step's Q before the power iteration: with ``warm_start`` the last step's, else (and where there is
        none yet, or the last one was not finite) one drawn afresh from a generator seeded from ``seed``, the
        bucket's index and ``iteration``, alike on every rank. Whether the last Q was finite is known on the
        device only, so a warm start draws a fresh Q every step and picks one of the two there (``torch.where``:
        either one's bits, as a choice on the host would give)."""
        q = state.q if self.warm_start else None
        if q is None or q.numel() != numel:
            return self.draw_q(numel, bucket, iteration, like)
        if state.q_finite is None:  # (drawn or loaded: finite)
            return q
        return torch.where(state.q_finite, q, self.draw_q(numel, bucket, iteration, like), out=q)

    def draw_q(self, numel: int, bucket: Bucket, iteration: int, like: Tensor) -> Tensor:
        """A Q drawn afresh, on ``like``'s device and in its dtype: from a CPU generator (the same numbers on every
        device), copied to a CUDA device from pinned memory, which the host need not wait for."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket.index * 1009 + iteration)
        q = torch.randn(numel, generator=g).to(like.dtype)
        if like.device.type == "cuda":
            return q.pin_memory().to(like.device, non_blocking=True)
        return q.to(like.device)


def rest_positions(segments: list[tuple[int, int, int]], numel: int, device: torch.device) -> Tensor:
    """The positions of a tensor of ``numel`` values outside the ``segments`` (``(offset, rows, cols)``, sorted
    by offset), ascending, as an int64 tensor built on ``device`` (ranges, no copy from the host)."""
    ranges, start = [], 0
    for o, rows, cols in segments:
        if o > start:
            ranges.append((start, o))
        start = o + rows * cols
    if numel > start:
        ranges.append((start, numel))
    if not ranges:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(a, b, dtype=torch.long, device=device) for a, b in ranges])


def _views(flat: Tensor, shapes: list[tuple[int, int]]) -> list[Tensor]:
    views, offset = [], 0
    for rows, cols in shapes:
        views.append(flat[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return views
