"""Value types that hooks exchange. They carry data, not behaviour, and import nothing from the strategy."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from ddp_plugin.hookspecs.tensors import local_tensor

if TYPE_CHECKING:
    from datetime import timedelta

    from torch import Tensor
    from torch.distributed import ProcessGroup, ReduceOp, Work
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn import Parameter


@dataclass(eq=False)
class Bucket:
    """A group of parameters whose gradients live side by side in one flat buffer.

    The engine builds buckets once, in reverse registration order of the parameters (the order in which
    backward produces their gradients), never mixing dtypes or devices. Every parameter's ``.grad`` is a view
    into ``buffer``, so a reducer that writes the averaged result into ``buffer`` in place has updated the
    gradients the optimizer will see.

    Attributes:
        index: position in the launch order; the same on every rank.
        buffer: the flat gradient buffer (1-D, contiguous).
        params: the parameters, in the order their gradients appear in ``buffer``.
        names: their qualified names in the module, for logging and checkpoints.
        offsets: start of each parameter's gradient in ``buffer``.
    """

    index: int
    buffer: Tensor
    params: tuple[Parameter, ...]
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    grad_used: list[bool] = field(default_factory=list)
    """After a synchronizing backward: whether any rank produced a gradient for ``params[i]`` (a parameter no
    rank used gets ``.grad = None``, as in one process)."""
    state: dict[str, Any] = field(default_factory=dict)
    """Scratch space a plugin may use for per-bucket data that lives as long as the bucket."""
    kind: str = "gradients"
    """What the bucket's tensors are: ``"gradients"`` (the engine's buckets), or ``"pseudo_gradient"`` (a sync mode's
    cross-node average of parameter changes, in the layout of the gradient bucket it comes from, with an
    ``index`` of its own), or ``"tied_gradient"`` (the gradient of a parameter several pipeline stages hold,
    averaged over its copies' ranks: ``index`` numbers the tie, ``params`` is the one parameter, and ``buffer``
    has its flat size but no memory). A codec keeps its per-bucket state (error feedback) per ``(kind, index)``."""

    @property
    def numel(self) -> int:
        return self.buffer.numel()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def released(self) -> bool:
        """Whether the buffer's memory was handed back (:meth:`release`); the engine re-allocates it, zeroed,
        when the next backward produces a gradient for the bucket."""
        return self.buffer.untyped_storage().nbytes() == 0

    def release(self) -> None:
        """Free the buffer's memory, keeping its shape and every view of it; for plugins that keep gradients
        elsewhere between steps (a ZeRO stage 2/3 sharder keeps only its shard). Parameters' ``.grad`` must not
        point into a released bucket."""
        self.buffer.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Allocate a released buffer again, filled with zeros (a no-op when it holds memory)."""
        if self.released:
            self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
            self.buffer.zero_()

    def grad_view(self, i: int) -> Tensor:
        """The slice of ``buffer`` that holds the gradient of ``params[i]``, shaped like this rank's part of the
        parameter (:func:`local_tensor`)."""
        p = local_tensor(self.params[i])
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: ``num_nodes`` nodes of ``ranks_per_node`` ranks, global rank = node * k + local
    (with tensor parallelism, of the data-parallel ranks: see ``tensor_parallel_size``).

    ``intra_node_group`` joins the ranks of this rank's node (fast links), ``inter_node_group`` joins the ranks
    with the same local rank on every node (the slow link); ``world_group`` joins everyone. ``mesh`` is the
    2-D device mesh (dims ``"node"`` and ``"local"``) the groups come from.

    The ``side_*`` groups join the same ranks as their namesakes but are separate process groups, for
    collectives issued on the training thread (a sharder's parameter all-gathers, a global gradient norm) while
    the communication thread may be using the main ones: collectives on one group must be issued in the same
    order on every rank, and two threads sharing a group cannot promise that.
    """

    world_size: int
    rank: int
    num_nodes: int
    ranks_per_node: int
    backend: str
    device: torch.device
    world_group: ProcessGroup
    intra_node_group: ProcessGroup
    inter_node_group: ProcessGroup
    mesh: DeviceMesh | None = None
    side_world_group: ProcessGroup | None = None
    side_intra_node_group: ProcessGroup | None = None
    side_inter_node_group: ProcessGroup | None = None
    timeout: timedelta | None = None
    """The strategy's collective timeout, which every group above honours; a plugin that creates groups of its own
    gets the same through ``comm.new_group(...)`` (:class:`Communicator`). ``None``: torch's."""
    tensor_parallel_size: int = 1
    """Ranks in a tensor-parallel group (``tensor_parallel_size``). Above 1, every field above describes the
    data-parallel ranks that hold the same tensor-parallel shard: ``world_size`` is the data-parallel size,
    ``rank`` this rank's data-parallel rank, ``ranks_per_node`` the data-parallel ranks of a node, and the groups
    join those ranks only, so a data-parallel plugin synchronizes local shards with their replicas and never
    mixes two shards. Global rank = data-parallel rank * ``tensor_parallel_size`` + tensor-parallel rank."""
    tensor_parallel_rank: int = 0
    """This rank's position in its tensor-parallel group (global rank = ``rank`` * ``tensor_parallel_size`` +
    this)."""
    tensor_parallel_group: ProcessGroup | None = None
    """The ranks that hold the other shards of this rank's tensor-parallel parameters (consecutive ranks inside
    one node), for collectives on the training thread (a global gradient norm); the module's own tensor-parallel
    collectives run on the device mesh's group, not this one. ``None`` without tensor parallelism."""

    pipeline_parallel_size: int = 1
    """Pipeline stages (``pipeline_parallel_size``). Above 1, every data-parallel field above describes this rank's
    stage only (its data-parallel ranks in its tensor-parallel position), so a data-parallel plugin synchronizes a
    stage's parameters with their replicas. Global rank = (pipeline rank * ``world_size`` + data-parallel rank) *
    ``tensor_parallel_size`` + tensor-parallel rank."""
    pipeline_parallel_rank: int = 0
    """This rank's pipeline stage (of the first virtual stage it runs)."""
    pipeline_parallel_group: ProcessGroup | None = None
    """The ranks of the other stages in this rank's data-parallel and tensor-parallel position, for collectives
    on the training thread (a global gradient norm over every stage). ``None`` without pipeline stages."""

    @property
    def node_rank(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def global_rank(self, rank: int, tensor_parallel_rank: int | None = None, pipeline_rank: int | None = None
                    ) -> int:
        """The global rank (what ``dist.new_group`` takes) of data-parallel rank ``rank`` in tensor-parallel
        position ``tensor_parallel_rank`` of pipeline stage ``pipeline_rank`` (defaults: this rank's). Without
        tensor or pipeline parallelism, ``rank`` itself. A plugin that makes groups of its own makes them for every
        tensor-parallel position and stage (creating a group is collective over the world) and keeps its own."""
        t = self.tensor_parallel_rank if tensor_parallel_rank is None else tensor_parallel_rank
        p = self.pipeline_parallel_rank if pipeline_rank is None else pipeline_rank
        return (p * self.world_size + rank) * self.tensor_parallel_size + t


@dataclass(frozen=True)
class Options:
    """The strategy's settings as plugins see them (``on_setup(options=...)``), validated and final: a DeepSpeed
    ``config`` is merged in, and the values left to the layout (``hierarchical``) are decided.

    Attributes:
        zero_stage: 0 (plain data parallel), 1, 2 or 3.
        shard_scope: ``"global"`` (shards over every rank) or ``"node"`` (over the ranks of a node).
        hierarchical: whether gradients are reduced in node, cross-node and gather stages (when the link probe
            chooses the route per bucket: whether any bucket may be).
        compression: the ``compression=`` name (``"auto"``: the link probe's choice per bucket), or ``None``.
        compression_options: the codec's options, read-only (a third-party codec validates its own).
        cross_node_codec: the name of the plugin that answers ``on_cross_node_reduce`` ahead of the plain
            averaging all-reduce (the codec, or a plugin of the user's; a sync mode's plugin is none), or
            ``None`` when the cross-node stage is the plain mean; a plugin that could take a cheaper path for a plain mean (a sharder's
            reduce-scatter) asks this instead of inspecting other plugins.
        bucket_size_mb: gradient bucket capacity in MiB (with ``"auto"``, the one chosen).
        broadcast_buffers: whether module buffers are broadcast from rank 0 before each training step.
        devices_per_node: the ``devices_per_node`` flag (``None``: the launcher's ranks per node).
    """

    zero_stage: int = 0
    shard_scope: Literal["global", "node"] = "global"
    hierarchical: bool = False
    compression: str | None = None
    compression_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    cross_node_codec: str | None = None
    bucket_size_mb: float = 25.0
    broadcast_buffers: bool = True
    devices_per_node: int | None = None


@dataclass(eq=False)
class ParameterShards:
    """This rank's part of every bucket's flat parameters, where a plugin may read and write parameter values
    between optimizer steps (a sync mode's outer optimizer does), answered by a ZeRO sharder at node scope.

    Attributes:
        parts: per bucket, in bucket order: ``(bucket, start, part)``, the 1-D tensor ``part`` holding elements
            ``[start, start + part.numel())`` of the bucket's flat parameters (laid out as ``bucket.offsets``
            says; padding past the last parameter). The ranks of a node hold disjoint parts that cover every
            bucket, and every node holds the same parts in the same places.
        publish: make the module's parameters hold the parts' values (a collective over the node's ranks, on
            the training thread). Values written before the sharder's own ``on_after_optimizer_step`` reach the
            module in that hook without it.
    """

    parts: list[tuple[Bucket, int, Tensor]]
    publish: Callable[[], None]


@dataclass
class Traffic:
    """Bytes this rank handed to the network, split by whether the receiver is on its node."""

    intra_node_bytes: int = 0
    cross_node_bytes: int = 0


class Communicator(Protocol):
    """The collectives a plugin may use, handed to it as ``on_setup(comm=...)``. Each one is the
    ``torch.distributed`` collective of the same meaning, and records what this rank sends and to whom (from
    the algorithm the backend runs), so that the strategy's traffic accounting (``comm/...`` metrics) counts
    it; collectives a plugin issues through ``torch.distributed`` directly are not counted. Every method takes
    the group (``None``: the world) and, where torch does, ``async_op`` (then it returns the work handle).
    With ``fault_tolerance`` the group of ``on_cross_node_reduce`` may be torchft's across replica groups:
    ``all_reduce``, ``all_gather`` and ``all_to_all`` run on it (every byte counted as crossing nodes),
    ``reduce_scatter`` and ``broadcast`` do not.
    """

    def all_reduce(self, tensor: Tensor, op: ReduceOp = ..., group: ProcessGroup | None = None,
                   async_op: bool = False, piece_bytes: int | None = None) -> Work | None:
        """Reduce ``tensor`` in place over ``group`` (sum by default). Sends 2(n-1)/n of it (ring). With
        ``piece_bytes``, on gloo, in pieces of at most that size queued at once (gloo allocates half of what it
        all-reduces while it runs): the same bytes and sums."""

    def reduce_scatter(self, output: Tensor, input: Tensor, group: ProcessGroup | None = None) -> Tensor:  # noqa: A002
        """Sum ``input`` (n equal chunks) over ``group`` and write chunk ``rank in group`` into ``output``;
        return ``output``, which may be ``input``'s own chunk (in place). Blocking. NCCL runs its native
        reduce-scatter; on gloo, which emulates one with a full all-reduce, rounds of all-to-alls that send each
        chunk once and add it into ``output`` a piece at a time, half the bytes: (n-1)/n of ``input`` either
        way."""

    def all_gather(self, output: Tensor, input: Tensor, group: ProcessGroup | None = None,  # noqa: A002
                   async_op: bool = False) -> Work | None:
        """Every rank's ``input`` into ``output``, in rank order; ``input`` may be this rank's chunk of
        ``output`` (in place). Sends (n-1) times ``input``."""

    def all_to_all(self, output: Tensor, input: Tensor, group: ProcessGroup | None = None,  # noqa: A002
                   async_op: bool = False) -> Work | None:
        """Equal splits: chunk j of ``input`` goes to rank j, which keeps it as chunk ``rank`` of ``output``."""

    def broadcast(self, tensor: Tensor, src: int, group: ProcessGroup | None = None,
                  async_op: bool = False) -> Work | None:
        """``tensor`` of rank ``src`` (its rank in ``group``) to every rank of ``group``, in place. The source
        sends it once to each other rank."""

    def new_group(self, ranks: list[int] | None = None, backend: str | None = None) -> ProcessGroup:
        """A process group of ``ranks`` (collective: every rank calls it) whose collectives fail after the
        strategy's ``timeout``, like every group of the strategy's (torch gives a new group 30 minutes)."""

    def bytes_sent_by_this_thread(self) -> int:
        """Bytes recorded so far by the calling thread: the difference around a call is what it sent."""

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D tensor of ``numel`` elements from the calling thread's arena, uninitialized: the memory that
        :meth:`reduce_scatter` receives into, kept from call to call (grown when needed), so that work which
        runs after a reduction on the same thread (a codec coding a reduced shard) needs no buffer of its own.
        Valid until the thread's next ``scratch`` or ``reduce_scatter`` call."""

    def take_traffic(self) -> Traffic:
        """The traffic recorded since the last call (every thread), resetting the tally."""


_deferred_order = itertools.count()


@dataclass(eq=False)
class DeferredStorage:
    """Checkpoint bytes that only exist collectively, produced while global rank 0 writes the file.

    A hook that builds a checkpoint (``on_optimizer_state_dict``, say) may return :class:`DeferredTensor`\\ s
    instead of tensors, so that rank 0 never holds all of a sharded state at once: when the checkpoint is
    saved, every rank calls ``produce()`` of every deferred storage in the checkpoint, in the order they were
    created (``order``), rank 0 receiving a 1-D tensor of ``numel`` elements of ``dtype`` (which it writes and
    frees) and the other ranks ``None``. ``produce`` may run collectives; every rank must build the same
    deferred storages in the same order. ``device`` is where the tensor is (as ``torch.save`` records it).
    """

    dtype: torch.dtype
    numel: int
    produce: Callable[[], Tensor | None]
    device: str = "cpu"
    order: int = field(default_factory=lambda: next(_deferred_order))


@dataclass(eq=False)
class DeferredTensor:
    """A tensor in a checkpoint whose data is ``numel(shape)`` contiguous elements of a :class:`DeferredStorage`
    from element ``offset``. A checkpoint written by ddp_plugin holds an ordinary tensor in its place."""

    storage: DeferredStorage
    offset: int
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype


def completed_future(value: Any = None) -> torch.futures.Future:
    """A future that is already done; for hooks that have nothing to wait for (e.g. a group of one rank)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
