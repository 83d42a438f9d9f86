"""The collectives the strategy and its plugins use, with traffic accounting, and the torch-version
differences in one place: :class:`TracedCommunicator` implements the contract's
:class:`~ddp_plugin.hookspecs.Communicator`, and one is handed to the plugins of every ``fit``.

Each method issues the torch.distributed collective and records what this rank sends and to whom, from the
algorithm the backend runs: a ring all-reduce sends 2(n-1)/n of the tensor to the next rank of the group, a
ring all-gather (n-1) input-sized chunks to the next rank, an all-to-all each chunk straight to its owner.
Whether a send stays inside a node or crosses to another follows from the two ranks' nodes.

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to ``reduce_scatter_single``/
``all_gather_single`` (the old names remain as deprecated aliases); the methods take whichever exists.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_plugin.hookspecs import Traffic
from ddp_plugin.runtime.topology import new_group

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


RS_PIECE_BYTES = 4 << 20
"""The most bytes one message of a gloo reduce-scatter carries (its receive buffer in the arena)."""


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _next_in_ring(group: dist.ProcessGroup) -> int:
    return (dist.get_rank(group) + 1) % dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (``None``: the world): ``torch.distributed``'s for a group it made; a
    process group it does not know (one a plugin made and reconfigures itself) answers for itself."""
    if group is None or group is dist.group.WORLD:
        return dist.get_rank()
    try:
        return dist.get_rank(group)
    except ValueError:  # (not registered with torch.distributed)
        return group.rank()


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements (what a collective sends of it)."""
    return t.numel() * t.element_size()


class TracedCommunicator:
    """Collectives that count this rank's traffic, split into intra-node and cross-node bytes by
    ``ranks_per_node`` (global rank = node * ranks_per_node + local rank); groups made by :meth:`new_group` fail
    their collectives after ``timeout``.

    Thread-safe: the communication thread and the training thread both record."""

    def __init__(self, ranks_per_node: int = 1, timeout: timedelta | None = None) -> None:
        self.ranks_per_node = ranks_per_node
        self.timeout = timeout
        self._traffic = Traffic()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._layouts: dict[int, bool] = {}

    # ------------------------------------------------------------------ accounting

    def _record(self, group: dist.ProcessGroup, sends: list[tuple[int, float]]) -> None:
        """``sends``: (destination rank within ``group``, bytes) pairs for this rank."""
        me = dist.get_rank() // self.ranks_per_node
        intra = cross = 0.0
        for dst, sent in sends:
            if dist.get_global_rank(group, dst) // self.ranks_per_node == me:
                intra += sent
            else:
                cross += sent
        self.count_bytes(intra, cross)

    def count_bytes(self, intra: float, cross: float) -> None:
        """Count bytes this rank sent inside its node and across nodes (also those of collectives this
        communicator does not issue: a transport's own across members)."""
        with self._lock:
            self._traffic.intra_node_bytes += int(intra)
            self._traffic.cross_node_bytes += int(cross)
        self._local.sent = self.bytes_sent_by_this_thread() + int(intra) + int(cross)

    def bytes_sent_by_this_thread(self) -> int:
        return getattr(self._local, "sent", 0)

    def take_traffic(self) -> Traffic:
        with self._lock:
            traffic, self._traffic = self._traffic, Traffic()
        return traffic

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, piece_bytes=None):
        """``dist.all_reduce``. With ``piece_bytes``, on gloo, in pieces of at most that many bytes, queued at once:
        gloo allocates half of what it all-reduces while it runs (measured with the heap tracker), so half a piece
        instead of half the tensor; the same bytes and sums."""
        group = _group(group)
        n = dist.get_world_size(group)
        if n > 1:
            self._record(group, [(_next_in_ring(group), 2 * (n - 1) / n * nbytes(tensor))])
        if (piece_bytes and n > 1 and dist.get_backend(group) == "gloo" and tensor.is_contiguous()
                and nbytes(tensor) > piece_bytes):
            flat = tensor.view(-1)
            piece = max(1, piece_bytes // tensor.element_size())
            reduced = _Works([dist.all_reduce(flat[a : a + piece], op=op, group=group, async_op=True)
                              for a in range(0, flat.numel(), piece)], tensor)
            if async_op:
                return reduced
            reduced.wait()
            return None
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def reduce_scatter(self, output, input, group=None):  # noqa: A002
        group = _group(group)
        n = dist.get_world_size(group)
        if n == 1:
            return output.copy_(input)
        if dist.get_backend(group) == "nccl":
            self._record(group, [(_next_in_ring(group), (n - 1) / n * nbytes(input))])
            _reduce_scatter_single(output, input, group=group)
            return output
        # gloo emulates reduce-scatter with a full all-reduce (2(n-1)/n of the input). Here each chunk is sent
        # once, (n-1)/n of the input, by n-1 rounds of all-to-alls in which every rank sends one chunk, in
        # pieces of at most RS_PIECE_BYTES, to the rank `s` after it and receives its own chunk from the rank
        # `s` before it into the arena, then adds it: the receive buffer is one piece, not a whole input (a
        # single all-to-all receives every chunk at once). Collectives, not point-to-point sends: a send left
        # pending to a peer that stopped holds the process at exit (tests/test_reliability.py), where a
        # collective's buffers time out with it. The sum starts from this rank's own chunk and adds the others
        # in the order received (with 2 ranks: the same bits as any order).
        me = dist.get_rank(group)
        c = output.numel()
        chunks = input.reshape(-1).split(c)
        acc = output.view(-1)
        if acc.data_ptr() != chunks[me].data_ptr():
            acc.copy_(chunks[me])
        piece = max(1, min(c, RS_PIECE_BYTES // input.element_size()))
        received = self.scratch(piece, input.dtype, input.device)
        for s in range(1, n):
            dst, src = (me + s) % n, (me - s) % n
            self._record(group, [(dst, c * input.element_size())])
            for a in range(0, c, piece):
                size = min(piece, c - a)
                send_splits, recv_splits = [0] * n, [0] * n
                send_splits[dst] = recv_splits[src] = size
                dist.all_to_all_single(received[:size], chunks[dst][a : a + size], recv_splits, send_splits,
                                       group=group)
                acc[a : a + size].add_(received[:size])
        return output

    def all_gather(self, output, input, group=None, async_op=False):  # noqa: A002
        """Every rank's ``input`` into ``output`` in rank order; ``input`` may be this rank's chunk of
        ``output`` (in place).

        On gloo, within one node or across nodes one rank each, as n broadcasts into ``output``'s chunks: gloo's
        own all-gather stages the whole output in a temporary buffer first (measured: one output's size
        allocated per call, per bucket and stage 3 unit and step), and the broadcasts send the same bytes per
        rank without one. Over a group that spans nodes with several ranks each, gloo's ring: it sends fewer
        bytes across nodes there."""
        group = _group(group)
        n = dist.get_world_size(group)
        if n > 1 and dist.get_backend(group) == "gloo" and output.is_contiguous() and self._one_rank_or_node(group):
            me = dist.get_rank(group)
            self._record(group, [(dst, nbytes(input)) for dst in range(n) if dst != me])
            c = input.numel()
            chunks = output.view(-1).split(c)
            if chunks[me].data_ptr() != input.data_ptr():
                chunks[me].copy_(input.reshape(-1))
            works = [dist.broadcast(chunks[j], src=dist.get_global_rank(group, j), group=group, async_op=True)
                     for j in range(n)]
            gathered = _Works(works, output)
            if async_op:
                return gathered
            gathered.wait()
            return None
        if n > 1:
            self._record(group, [(_next_in_ring(group), (n - 1) * nbytes(input))])
        return _all_gather_single(output, input, group=group, async_op=async_op)

    def _one_rank_or_node(self, group: dist.ProcessGroup) -> bool:
        """Whether ``group``'s ranks are all on one node, or each on a node of its own."""
        key = id(group)
        known = self._layouts.get(key)
        if known is None:
            ranks = dist.get_process_group_ranks(group)
            nodes = {r // self.ranks_per_node for r in ranks}
            known = self._layouts[key] = len(nodes) in (1, len(ranks))
        return known

    def all_to_all(self, output, input, group=None, async_op=False):  # noqa: A002
        group = _group(group)
        n = dist.get_world_size(group)
        if n > 1:
            me = dist.get_rank(group)
            chunk = nbytes(input) / n
            self._record(group, [(dst, chunk) for dst in range(n) if dst != me])
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        """``tensor`` of rank ``src`` (rank in ``group``) to every rank of ``group``: the source sends it to each
        (gloo's algorithm for a group this small; NCCL's ring sends as much in all)."""
        group = _group(group)
        n = dist.get_world_size(group)
        if n > 1 and dist.get_rank(group) == src:
            self._record(group, [(dst, nbytes(tensor)) for dst in range(n) if dst != src])
        return dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group, async_op=async_op)

    def new_group(self, ranks=None, backend=None):
        return new_group(ranks, backend=backend, timeout=self.timeout)

    def count_sends(self, group: dist.ProcessGroup, sends: list[tuple[int, float]]) -> None:
        """Count point-to-point sends another library issued (a pipeline schedule's activations and their
        gradients): (destination rank within ``group``, bytes) pairs for this rank."""
        self._record(_group(group), sends)

    # ------------------------------------------------------------------ scratch space

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This thread's arena, as ``numel`` elements of ``dtype`` on ``device`` (see the contract): one byte
        buffer per thread and device, reused from call to call (grown when needed). A bucket-sized buffer
        allocated every step only churns the allocator, and on CPU fragments the heap (measured: RSS grew by 2x
        the gradient size over 40 steps); sharing it between the reduce-scatter and the codec that codes its
        result keeps one such buffer instead of two."""
        arenas: dict[torch.device, torch.Tensor] = self._local.__dict__.setdefault("arenas", {})
        device = torch.device(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        size = numel * itemsize
        arena = arenas.get(device)
        if arena is None or arena.numel() < size:
            # Whole float64 words, so every dtype's view of the start is aligned.
            arena = arenas[device] = torch.empty(-(-size // 8), dtype=torch.float64, device=device).view(torch.uint8)
        return arena[:size].view(dtype)

    def release_scratch(self) -> None:
        """Drop this thread's arena (the training thread's, after a link probe used it once)."""
        self._local.__dict__.pop("arenas", None)


class _Works:
    """Several works that make one collective (an all-gather's broadcasts, an all-reduce's pieces), as one work:
    ``wait()``, and ``get_future()`` whose value is the output."""

    def __init__(self, works: list, output: torch.Tensor) -> None:
        self.works, self.output = works, output

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        output = self.output

        def done(every: torch.futures.Future) -> list[torch.Tensor]:
            for fut in every.value():
                fut.value()  # a part that failed (a peer stopped) fails the whole
            return [output]

        return torch.futures.collect_all([w.get_future() for w in self.works]).then(done)


# ---------------------------------------------------------------------- checkpoint gathers (not counted)

GATHER_CHUNK = 1 << 18
"""Elements per ``dist.gather`` when checkpoint state is gathered to rank 0 (1 MiB of fp32 per rank)."""


def gather_flat_to_root(local: torch.Tensor, group: dist.ProcessGroup, index_of: list[int]) -> torch.Tensor | None:
    """Every rank's shard-sized ``local`` assembled in shard order on the group's first rank (else None),
    received straight into one buffer, in chunks (gloo's gather stages its output in a buffer of its own:
    chunks keep that small). Checkpoint bookkeeping, not training traffic: not counted."""
    root = dist.get_global_rank(group, 0)
    if dist.get_rank() != root:
        for a in range(0, local.numel(), GATHER_CHUNK):
            dist.gather(local[a : a + GATHER_CHUNK], None, dst=root, group=group)
        return None
    c = local.numel()
    full = local.new_empty(c * len(index_of))
    for a in range(0, c, GATHER_CHUNK):
        z = min(a + GATHER_CHUNK, c)
        dist.gather(local[a:z], [full[idx * c + a : idx * c + z] for idx in index_of], dst=root, group=group)
    return full


BROADCAST_BUCKET_BYTES = 250 * 2**20
"""The most bytes one broadcast of :func:`broadcast_coalesced` carries (DDP's module-state sync uses the same)."""


def broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Every tensor takes the value it has on the group's first rank, in place: tensors of one dtype and device
    are flattened together, up to ``bucket_bytes`` a broadcast (what DDP does at its start; its
    ``_broadcast_coalesced`` is private API). Collective over ``group`` (default the world), whose ranks pass
    tensors of the same shapes in the same order."""
    group = _group(group)
    if dist.get_world_size(group) == 1:
        return
    runs: dict[tuple[torch.dtype, torch.device], list[tuple[list[torch.Tensor], int]]] = {}
    for t in tensors:
        buckets = runs.setdefault((t.dtype, t.device), [([], 0)])
        members, size = buckets[-1]
        if members and size + nbytes(t) > bucket_bytes:
            buckets.append(([], 0))
            members, size = buckets[-1]
        members.append(t)
        buckets[-1] = (members, size + nbytes(t))
    with torch.no_grad():
        for buckets in runs.values():
            for bucket, _ in buckets:
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    dist.broadcast(bucket[0], group=group, group_src=0)  # (in place: no copy)
                    continue
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.broadcast(flat, group=group, group_src=0)
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                    t.copy_(part.view_as(t))
