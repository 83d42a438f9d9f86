"""Sparse, low-bit coding (``compression="sparse"``): top-k inside each chunk, the kept values in 2, 4 or 8 bits
with one scale per chunk, the indices in 16 bits, and error feedback with a decay. Meant for the pseudo-gradients
of a sync mode (SparseLoCo's coding: 1-3 % of each chunk, 2 bits, the decayed error-feedback accumulator), and
usable on gradients.

Two aggregations (``compression_options["aggregation"]``):

- ``"all_gather"`` (the default): each rank's payload (one byte buffer: the chunks' scales, the kept entries'
  indices in their chunk, the packed levels) is all-gathered, and every rank decodes every rank's in rank order
  into zeros and divides by n: the same bits everywhere (each rank keeps other indices, so the sum is gathered,
  not all-reduced). What a rank sends and receives grows with n.
- ``"reduce_scatter"``: the C chunks are cut into n contiguous ranges of ``C // n`` or ``C // n + 1`` chunks (range
  r: chunks ``r C // n`` to ``(r + 1) C // n``), rank r owning range r. Each rank sends each owner its coded
  entries of the owner's chunks (one all-to-all of byte buffers, every range's slot the size of ``ceil(C / n)``
  chunks, a shorter range padded with an empty chunk); the owner decodes the n versions in rank order, sums them,
  divides by n, adds its own second residual, and codes its range again (top-k and levels with the same
  ``density`` and ``bits``); the coded ranges are all-gathered and every rank decodes the same bytes: the same
  bits everywhere. What a rank sends and receives stays about two payloads, whatever n.
- ``"auto"``: per tensor, ``"reduce_scatter"`` where it sends fewer bytes than ``"all_gather"`` (2 P < B below:
  from 3 ranks on, unless the tensor has too few chunks to split), else ``"all_gather"``.

Bytes a rank sends for a tensor of N elements in chunks of c, keeping k = ceil(density * c) a chunk, with
C = ceil(N / c) chunks and B = C * (4 + k * (2 + bits / 8)) the payload (rounded up to whole bytes and to 4):
all-gather (n - 1) * B; reduce-scatter 2 (n - 1) * P, P the payload of ceil(C / n) chunks (about B / n): about
2 (n - 1) / n * B, what a ring all-reduce of the payload would send. A float32 ring all-reduce sends
2 (n - 1) / n * 4 N. At density 1.5 %, 2 bits and chunks of 4096 that is 0.28 bits an element: 115x fewer bytes
than fp32 on 2 nodes with either aggregation; on 4 nodes the all-gather sends 3 B, the reduce-scatter about 1.5 B.

The reduce-scatter codes twice: the mean of n sparse payloads holds up to n k entries a chunk, of which the owner
sends k. With error feedback what it leaves out (and its rounding) is the owner's second residual, kept per rank
beside the first (``owner_residual``, for the range of the rank and group size it was made with, which it saves
and restores with the first) and decayed by the same ``decay`` each step before the next mean is added to it, so
that it too is only delayed; where the range changes (the group's size or this rank's place in it, as the members
of a fault-tolerant group come and go, or ``"auto"`` taking the all-gather) it is added, times n, to this rank's
own values of that range on the next step, and so reaches the mean then. Without error feedback the second
coding's remainder is dropped, as the first's is.

``warmup_syncs`` (0 by default): the first ``warmup_syncs`` codings of each bucket (with a sync mode: the first
syncs of each fragment) are not sparse but dense, block-wise int8 as ``compression="int8"`` codes them (its
all-to-all and all-gather, blocks of 1024, without error feedback: every rank the same bits), and the sparse
coding starts after them with an empty residual. It is for the start of training from a large initialization,
when the pseudo-gradients are large and dense and a few percent of each chunk carries too little of them
(docs/sync.md). The count is shared state (``codings``, the same on every rank), saved in checkpoints.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ddp_plugin.codecs.base import BucketState, Codec
from ddp_plugin.codecs.int8 import Int8Codec, Int8State, finite_or_zero
from ddp_plugin.runtime.checks import check_bool, check_int, check_number, invalid
from ddp_plugin.runtime.comm import group_rank
from ddp_plugin.hookspecs import completed_future

INDEX_OFFSET = 2**15
"""An index in its chunk (0 to 65535) is sent as a 16-bit signed integer, less this."""


AGGREGATIONS = ("all_gather", "reduce_scatter", "auto")
"""``compression_options["aggregation"]``'s values (see the module docstring)."""


class SparseState(BucketState):
    """``residual``: the first coding's (this rank's values, padded to whole chunks); with the reduce-scatter,
    ``owner_residual``: the second coding's, of the range this rank owned (``ceil(C / n)`` chunks, the last one
    zeros where the range is shorter), made as rank ``owner_rank`` of a group of ``owner_size``. ``codings``: how
    many times the bucket was coded (the same on every rank: it decides where ``warmup_syncs`` ends)."""

    shared = ("codings",)
    per_rank = ("residual", "owner_residual", "owner_rank", "owner_size")


class SparseCodec(Codec):
    """Top-k per chunk, quantized, with error feedback (see the module docstring).

    Per step and bucket: ``x = decay * residual + g`` (with error feedback), cut into chunks of ``chunk`` elements
    (the last one padded with zeros); each chunk keeps its ``k`` entries of largest magnitude, quantized to
    ``2**bits`` levels spread evenly over ``[-s, s]`` (``s`` the chunk's largest kept magnitude, sent as float32);
    the residual is what was not sent, the quantization's error included.

    Options: ``density`` (0.015: the share of each chunk kept, in (0, 1]), ``bits`` (2, 4 or 8), ``chunk``
    (4096: elements a chunk, 2 to 65536), ``decay`` (1.0: the residuals' factor each step, in [0, 1]; SparseLoCo
    uses 0.95, the accumulator then standing in for the outer momentum), ``error_feedback`` (True),
    ``aggregation`` (``"all_gather"``, ``"reduce_scatter"`` or ``"auto"``: how the ranks' payloads are combined),
    ``warmup_syncs`` (0: the first codings of each bucket sent dense in int8 instead, see the module docstring).

    The default aggregation stays the all-gather, which every rank's entries reach as they were coded: the
    reduce-scatter codes the mean a second time (its remainder waits in the owner's residual), which changes the
    results a run gets, and on 2 ranks it sends as many bytes. ``"auto"`` takes the reduce-scatter exactly where it
    sends fewer bytes (:meth:`aggregation_for`), from 3 ranks on.
    """

    name = "sparse"
    defaults: ClassVar[dict[str, Any]] = {"density": 0.015, "bits": 2, "chunk": 4096, "decay": 1.0,
                                          "error_feedback": True, "aggregation": "all_gather",
                                          "warmup_syncs": 0}
    State = SparseState

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.density = float(self.options["density"])
        self.bits = int(self.options["bits"])
        self.chunk = int(self.options["chunk"])
        self.decay = float(self.options["decay"])
        self.error_feedback = bool(self.options["error_feedback"])
        self.aggregation = str(self.options["aggregation"])
        self.warmup_syncs = int(self.options["warmup_syncs"])
        self._dense = Int8Codec(error_feedback=False)  # (the warmup's coding: stateless, the same bits everywhere)
        self._slot_rows: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    @classmethod
    def check_values(cls, options: dict[str, Any]) -> None:
        check_number("compression_options['density']", options["density"], minimum=0, maximum=1,
                     expected="a number in (0, 1]", context=cls.context())
        if options["bits"] not in (2, 4, 8) or isinstance(options["bits"], bool):
            raise invalid("compression_options['bits']", options["bits"], "2, 4 or 8", context=cls.context())
        check_int("compression_options['chunk']", options["chunk"], minimum=2, maximum=2**16,
                  expected="an integer from 2 to 65536", context=cls.context())
        check_number("compression_options['decay']", options["decay"], minimum=0, maximum=1,
                     strict=False, expected="a number in [0, 1]", context=cls.context())
        check_int("compression_options['warmup_syncs']", options["warmup_syncs"], minimum=0,
                  expected="an integer >= 0", context=cls.context())
        check_bool("compression_options['error_feedback']", options["error_feedback"], context=cls.context())
        if not isinstance(options["aggregation"], str) or options["aggregation"] not in AGGREGATIONS:
            raise invalid("compression_options['aggregation']", options["aggregation"],
                          ", ".join(map(repr, AGGREGATIONS)), context=cls.context())
        if options["decay"] != 1.0 and not options["error_feedback"]:
            raise ValueError(f"`compression_options['decay']={options['decay']}` decays the error-feedback residual, and"
                             f" `error_feedback=False` keeps none ({cls.context()}): drop `decay`, or keep error feedback.")

    @property
    def keeps_rank_state(self) -> bool:
        return self.error_feedback

    def layout(self, numel: int) -> tuple[int, int, int]:
        """``(c, chunks, k)``: the chunk size for a tensor of ``numel`` elements (at most ``numel``), the number of
        chunks, and the entries each keeps."""
        c = min(self.chunk, numel)
        return c, -(-numel // c), min(c, max(1, math.ceil(self.density * c)))

    def payload_bytes(self, numel: int) -> int:
        """Bytes of one rank's payload for a tensor of ``numel`` elements (B in the module docstring)."""
        _, chunks, k = self.layout(numel)
        return self._coded_bytes(chunks, k)

    def slot_bytes(self, numel: int, n: int) -> int:
        """Bytes of one range's payload with the reduce-scatter over ``n`` ranks (P: ``ceil(C / n)`` chunks)."""
        _, chunks, k = self.layout(numel)
        return self._coded_bytes(-(-chunks // n), k)

    def _coded_bytes(self, chunks: int, k: int) -> int:
        return _round4(chunks * 4 + chunks * k * 2 + -(-chunks * k * self.bits // 8))

    def aggregation_for(self, numel: int, n: int) -> str:
        """The aggregation a tensor of ``numel`` elements takes over ``n`` ranks: the option, or with ``"auto"`` the
        reduce-scatter where it sends fewer bytes, 2 (n - 1) P < (n - 1) B (the same answer on every rank)."""
        if self.aggregation != "auto":
            return self.aggregation
        return "reduce_scatter" if 2 * self.slot_bytes(numel, n) < self.payload_bytes(numel) else "all_gather"

    def bytes_sent(self, numel: int, n: int) -> int:
        """What one rank sends for a tensor of ``numel`` elements over ``n`` ranks (the module docstring's formulas,
        as the communicator counts them) once the ``warmup_syncs`` (int8's bytes) are done."""
        if n == 1:
            return 0
        if self.aggregation_for(numel, n) == "reduce_scatter":
            return 2 * (n - 1) * self.slot_bytes(numel, n)
        return (n - 1) * self.payload_bytes(numel)

    @staticmethod
    def ranges(chunks: int, n: int) -> list[tuple[int, int]]:
        """The reduce-scatter's ranges of chunks, ``[lo, hi)`` for each rank: contiguous, of ``chunks // n`` or one
        more (empty ones where there are fewer chunks than ranks)."""
        return [(r * chunks // n, (r + 1) * chunks // n) for r in range(n)]

    def reduce(self, tensor, group, n, bucket, offset, state):
        done = state.codings or 0
        state.codings = done + 1
        if done < self.warmup_syncs:  # dense, in int8: the residuals stay as they are (empty, at the start)
            self._dense.comm = self.comm
            return self._dense.reduce(tensor, group, n, bucket, offset, Int8State(tensor.numel()))
        numel = tensor.numel()
        c, chunks, k = self.layout(numel)
        padded = chunks * c
        x = self._accumulated(tensor, state, padded)
        scattered = self.aggregation_for(numel, n) == "reduce_scatter"
        rank = group_rank(group) if scattered or state.owner_residual is not None else -1
        if state.owner_residual is not None and (not scattered or (state.owner_rank, state.owner_size) != (rank, n)):
            # The second residual of a range this rank no longer owns: into its own values, to reach this mean.
            self._fold_owner(state, x, chunks, c, n)
        magnitudes = self.comm.scratch(padded, torch.float32, x.device).view(chunks, c)
        scales, indices, levels = self._code(x.view(chunks, c), magnitudes, k)
        if self.error_feedback:
            state.residual = finite_or_zero(x)
        if scattered:
            self._reduce_scatter(tensor, group, n, rank, state, scales, indices, levels)
            return completed_future(tensor)
        mine = self._pack(scales, indices, levels)
        gathered = mine.new_empty(n * mine.numel())
        self.comm.all_gather(gathered, mine, group=group)
        out = self.comm.scratch(padded, torch.float32, tensor.device).zero_()  # (the magnitudes are done with)
        total = out.view(chunks, c)
        for r in range(n):  # every rank's entries in rank order: the same sums, bit for bit, on every rank
            self._add_decoded(total, gathered[r * mine.numel() : (r + 1) * mine.numel()], chunks, k)
        tensor.copy_(out[:numel].div_(n).view_as(tensor))
        return completed_future(tensor)

    def _reduce_scatter(self, tensor: torch.Tensor, group: Any, n: int, rank: int, state: SparseState,
                        scales: torch.Tensor, indices: torch.Tensor, levels: torch.Tensor) -> None:
        """The reduce-scatter aggregation (module docstring) of this rank's coded chunks, its mean into ``tensor``."""
        numel, dev = tensor.numel(), scales.device
        c, chunks, k = self.layout(numel)
        m = -(-chunks // n)
        bounds = self.ranges(chunks, n)
        slots = self._slots(chunks, n, dev)
        s_slots = torch.cat([scales, scales.new_zeros(1)]).index_select(0, slots).view(n, m)
        i_slots = torch.cat([indices, indices.new_zeros(1, k)]).index_select(0, slots).view(n, m, k)
        l_slots = torch.cat([levels, levels.new_zeros(1, k)]).index_select(0, slots).view(n, m, k)
        send = torch.cat([self._pack(s_slots[r], i_slots[r], l_slots[r]) for r in range(n)])
        size = send.numel() // n  # (P: every slot packs m chunks)
        # Received into zeros: a collective of a fault-tolerant group that was skipped or failed without raising (its
        # step commits nothing) leaves bytes that decode to zeros, not indices past a chunk's end.
        received = torch.zeros_like(send)
        self.comm.all_to_all(received, send, group=group)

        # This rank's range: the n versions in rank order, their mean, plus the second residual, coded again.
        work = self.comm.scratch(2 * m * c, torch.float32, dev)
        total = work[: m * c].view(m, c).zero_()
        for r in range(n):
            self._add_decoded(total, received[r * size : (r + 1) * size], m, k)
        total.div_(n)
        y = total
        if self.error_feedback:
            owed = state.owner_residual
            if owed is None or owed.numel() != m * c or owed.device != dev:
                owed = torch.zeros(m * c, dtype=torch.float32, device=dev)
            elif self.decay != 1.0:
                owed.mul_(self.decay)
            y = owed.view(m, c).add_(total)  # (becomes the next second residual)
        mine = self._pack(*self._code(y, work[m * c :].view(m, c), k))
        if self.error_feedback:
            state.owner_residual = finite_or_zero(y.view(-1))
            state.owner_rank, state.owner_size = rank, n

        gathered = torch.zeros(n * size, dtype=torch.uint8, device=dev)  # (zeros: as above)
        self.comm.all_gather(gathered, mine, group=group)
        out = self.comm.scratch(chunks * c, torch.float32, dev).zero_()  # (the owner's work is done with)
        result = out.view(chunks, c)
        for r, (lo, hi) in enumerate(bounds):  # every owner's range from the same bytes: the same bits everywhere
            if hi > lo:
                self._add_decoded(result[lo:hi], gathered[r * size : (r + 1) * size], m, k)
        tensor.copy_(out[:numel].view_as(tensor))

    def _code(self, rows: torch.Tensor, magnitudes: torch.Tensor, k: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's ``k`` entries of largest magnitude (``magnitudes``: scratch of ``rows``' shape), quantized:
        ``(scales, indices, levels)``; with error feedback ``rows`` is left holding what was not sent (everything
        but the kept entries, and their quantization's error)."""
        indices = torch.abs(rows, out=magnitudes).topk(k, dim=1, sorted=False).indices
        values = rows.gather(1, indices)
        scales = values.abs().amax(dim=1)
        levels = self._quantize(values, scales)
        if self.error_feedback:
            rows.scatter_(1, indices, values.sub_(self._dequantize(levels, scales)))
        return scales, indices, levels

    def _add_decoded(self, total: torch.Tensor, payload: torch.Tensor, chunks: int, k: int) -> None:
        """Add the entries ``payload`` (a packed payload of ``chunks`` chunks) codes into ``total``'s rows (its
        first rows where it has fewer: a shorter range's padding is left out)."""
        scales, indices, levels = self._unpack(payload, chunks, k)
        rows = total.shape[0]
        # (a no-op on a payload this codec packed; an all-zero payload, what a failed collective leaves, reads as
        # index 2**15, past a chunk: with scale 0 it adds nothing where it is kept in)
        indices = indices[:rows].clamp_(max=total.shape[1] - 1)
        total.scatter_add_(1, indices, self._dequantize(levels[:rows], scales[:rows]))

    def _slots(self, chunks: int, n: int, device: torch.device) -> torch.Tensor:
        """The rows of the chunks every owner's slot holds, owner after owner: its range's chunks, then ``chunks``
        (an empty row: scale 0, which decodes to zeros) up to ``ceil(chunks / n)``. Kept per layout and device (the
        same every step)."""
        key = (chunks, n, torch.device(device))
        slots = self._slot_rows.get(key)
        if slots is None:
            m = -(-chunks // n)
            rows = torch.full((n, m), chunks, dtype=torch.long)
            for r, (lo, hi) in enumerate(self.ranges(chunks, n)):
                rows[r, : hi - lo] = torch.arange(lo, hi)
            slots = self._slot_rows[key] = rows.view(-1).to(device)
        return slots

    def _fold_owner(self, state: SparseState, flat: torch.Tensor, chunks: int, c: int, n: int) -> None:
        """Add the second residual, times ``n`` (the size of the group whose mean it is to reach), to the values of
        the range it was kept for in ``flat`` (this rank's values, 1-D), and forget it."""
        owed, rank, size = state.owner_residual, state.owner_rank, state.owner_size
        state.owner_residual = state.owner_rank = state.owner_size = None
        if owed is None or rank is None or size is None or not 0 <= rank < size:
            return
        lo, hi = self.ranges(chunks, size)[rank]
        a, z = lo * c, min(hi * c, flat.numel())
        if z > a and owed.numel() == -(-chunks // size) * c:
            flat[a:z].add_(owed[: z - a].to(device=flat.device, dtype=flat.dtype), alpha=n)

    def fold_residual(self, key: int | str, tensor: torch.Tensor, rank: int, n: int) -> None:
        """Both residuals (see :meth:`Codec.fold_residual`): this rank's own, and the second one of the range it
        owned (the error of the mean there): added ``n`` times to this rank's values of that range, it adds
        itself to the mean."""
        state = self.states.get(key)
        super().fold_residual(key, tensor, rank, n)
        if state is not None and state.owner_residual is not None and state.numel == tensor.numel():
            c, chunks, _ = self.layout(tensor.numel())
            self._fold_owner(state, tensor.view(-1), chunks, c, n)

    def _accumulated(self, tensor: torch.Tensor, state: SparseState, padded: int) -> torch.Tensor:
        """``decay * residual + tensor`` in float32, padded with zeros to ``padded`` elements: in the residual's own
        memory (the next residual) with error feedback, else a new buffer."""
        numel = tensor.numel()
        residual = state.residual if self.error_feedback else None
        if residual is not None and residual.numel() == padded and residual.device == tensor.device:
            x = residual.mul_(self.decay) if self.decay != 1.0 else residual
            x[:numel].add_(tensor.reshape(-1).float())
            return x
        x = torch.zeros(padded, dtype=torch.float32, device=tensor.device)
        x[:numel].copy_(tensor.reshape(-1))
        return x

    def _quantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Each value's level, 0 to ``2**bits - 1`` (level ``q`` decodes to ``(q - m) * step``, ``m`` the middle)."""
        top = 2**self.bits - 1
        step = scales * (2.0 / top)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        return values.div(safe[:, None]).add_(top / 2).round_().clamp_(0, top).to(torch.uint8)

    def _dequantize(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        top = 2**self.bits - 1
        return levels.float().sub_(top / 2).mul_((scales * (2.0 / top))[:, None])

    def _pack(self, scales: torch.Tensor, indices: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """One byte buffer: the float32 scales, the int16 indices, the levels ``8 / bits`` to a byte."""
        per_byte = 8 // self.bits
        flat = levels.reshape(-1)
        if flat.numel() % per_byte:
            flat = torch.cat([flat, flat.new_zeros(per_byte - flat.numel() % per_byte)])
        flat = flat.view(-1, per_byte)
        packed = flat[:, 0].clone()
        for j in range(1, per_byte):
            packed |= flat[:, j] << (j * self.bits)
        parts = [scales.float().contiguous().view(torch.uint8),
                 (indices - INDEX_OFFSET).to(torch.int16).reshape(-1).view(torch.uint8), packed]
        size = sum(p.numel() for p in parts)
        return torch.cat(parts + [packed.new_zeros(_round4(size) - size)])

    def _unpack(self, payload: torch.Tensor, chunks: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_byte = 8 // self.bits
        scales = payload[: 4 * chunks].view(torch.float32)
        start = 4 * chunks
        indices = payload[start : start + 2 * chunks * k].view(torch.int16).long().add_(INDEX_OFFSET).view(chunks, k)
        start += 2 * chunks * k
        packed = payload[start : start + -(-chunks * k // per_byte)]
        mask = 2**self.bits - 1
        levels = torch.stack([(packed >> (j * self.bits)) & mask for j in range(per_byte)], dim=1).reshape(-1)
        return scales, indices, levels[: chunks * k].view(chunks, k)

    def residual_numel(self, numel: int) -> int:
        c, chunks, _ = self.layout(numel)
        return chunks * c  # (kept padded to whole chunks)


def _round4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4
