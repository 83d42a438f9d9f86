"""What every built-in codec shares: options checked at construction, per-bucket state objects, the state
hooks, and the one-rank shortcut.

A codec answers ``on_cross_node_reduce`` (the contract's cross-node stage) with fewer bytes than a float32
all-reduce. Its state between steps lives in one :class:`BucketState` per bucket, created on first use and
reset when the bucket's tensor changes size. A state declares which of its fields are the same on every rank
(``shared``: iteration counts, PowerSGD's Q, kept when a run resumes on another world size) and which differ
(``per_rank``: error-feedback residuals); the codec returns them through ``on_save_state_dict`` and
``on_save_rank_state_dict``, and the strategy collects every rank's part, so no codec runs a collective to
save.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from ddp_plugin.runtime.checks import check_options
from ddp_plugin.hookspecs import completed_future, hookimpl

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.hookspecs import Bucket, Communicator

log = logging.getLogger(__name__)


class BucketState:
    """One bucket's codec state. Subclasses name their fields in ``shared`` and ``per_rank``; a field is a
    tensor, a number, or ``None`` (not yet set)."""

    shared: ClassVar[tuple[str, ...]] = ()
    per_rank: ClassVar[tuple[str, ...]] = ()

    def __init__(self, numel: int) -> None:
        self.numel = numel
        for name in (*self.shared, *self.per_rank):
            setattr(self, name, None)

    def as_dict(self) -> dict[str, Any]:
        """Every field that is set, by name."""
        return {n: v for n in (*self.shared, *self.per_rank) if (v := getattr(self, n)) is not None}

    def state_dict(self) -> dict[str, Any]:
        """The shared fields (and ``numel``), on the CPU."""
        return {"numel": self.numel, **_cpu({n: getattr(self, n) for n in self.shared})}

    def rank_state_dict(self) -> dict[str, Any]:
        """The per-rank fields (and ``numel``), on the CPU."""
        return {"numel": self.numel, **_cpu({n: getattr(self, n) for n in self.per_rank})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the shared fields ``state`` holds."""
        for name in self.shared:
            if name in state:
                setattr(self, name, state[name])

    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the per-rank fields ``state`` holds."""
        for name in self.per_rank:
            if name in state:
                setattr(self, name, state[name])

    def copy(self, into: BucketState | None = None) -> BucketState:
        """A copy whose fields hold the values they hold now, in memory of their own; other attributes (what a
        codec derives from the bucket's layout, or a buffer a field views) are shared. Each tensor is written into
        ``into``'s tensor of the same field where that has its shape, dtype and device and does not share this
        state's memory, fields or others (an earlier copy's, taken again), else cloned."""
        fields = (*self.shared, *self.per_rank)
        old = {n: getattr(into, n, None) for n in fields} if type(into) is type(self) else {}
        taken = {v.untyped_storage().data_ptr() for v in self.__dict__.values() if isinstance(v, torch.Tensor)}
        copy = into if old else object.__new__(type(self))
        copy.__dict__.clear()
        copy.__dict__.update(self.__dict__)
        for name in fields:
            value, mine = getattr(self, name), old.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            if (isinstance(mine, torch.Tensor) and mine.shape == value.shape and mine.dtype == value.dtype
                    and mine.device == value.device and mine.untyped_storage().data_ptr() not in taken):
                setattr(copy, name, mine.copy_(value))
            else:
                setattr(copy, name, value.clone())
        return copy

    def to(self, device: torch.device) -> None:
        for name in (*self.shared, *self.per_rank):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(self, name, value.to(device))


def _cpu(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in values.items()
            if v is not None}


class Codec:
    """A built-in codec plugin. Subclasses set ``name``, ``defaults`` (the accepted options and their values),
    ``State`` (their :class:`BucketState`), check option values in :meth:`check_values` and implement
    :meth:`reduce`."""

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    State: ClassVar[type[BucketState]] = BucketState

    def __init__(self, **options: Any) -> None:
        self.options = self.check_options(options)
        self.states: dict[int | str, BucketState] = {}
        self.comm: Communicator | None = None
        self._before: dict[int | str, BucketState | None] = {}
        """The states of the buckets of a try that may be discarded, as they were before it (``on_cross_node_try``);
        ``None`` for a bucket that had none."""
        self._spare: dict[int | str, BucketState] = {}
        """Per bucket, a settled try's other state, whose memory the next try's copy takes (none allocated per
        step)."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options with defaults filled in; ``ValueError`` naming the option for a bad name or value."""
        check_options(f"`compression={cls.name!r}`", options, cls.defaults)
        merged = {**cls.defaults, **options}
        cls.check_values(merged)
        return merged

    @classmethod
    def check_values(cls, options: dict[str, Any]) -> None:
        """Raise for a bad option value (``ddp_plugin.runtime.checks`` with ``context=cls.context()``)."""

    @classmethod
    def context(cls) -> str:
        return f"`compression={cls.name!r}`"

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({args})"

    # -------------------------------------------------------------- hooks

    @hookimpl
    def on_setup(self, comm: Communicator) -> None:
        self.comm = comm

    @hookimpl
    def on_cross_node_reduce(self, tensor: Tensor, group: dist.ProcessGroup, bucket: Bucket, offset: int
                             ) -> torch.futures.Future:
        n = dist.get_world_size(group)
        if n == 1:  # a group of one rank already holds its mean: nothing is sent or compressed
            return completed_future(tensor)
        assert self.comm is not None, "on_setup must run before the first reduction"
        return self.reduce(tensor, group, n, bucket, offset, self.bucket_state(state_key(bucket), tensor))

    def reduce(self, tensor: Tensor, group: dist.ProcessGroup, n: int, bucket: Bucket, offset: int,
               state: BucketState) -> torch.futures.Future:
        """Write the mean of ``tensor`` over the ``n`` ranks of ``group`` into it, in place."""
        raise NotImplementedError

    def bucket_state(self, index: int | str, tensor: Tensor) -> BucketState:
        """This bucket's state (``index``: :func:`state_key`), on ``tensor``'s device; started afresh if it was
        saved for another size."""
        state = self.states.get(index)
        if state is not None and state.numel != tensor.numel():
            log.warning("ddp_plugin %s codec: state of bucket %s was saved for %d values, the bucket now has %d;"
                        " starting that bucket afresh.", self.name, index, state.numel, tensor.numel())
            state = None
        if state is None:
            state = self.states[index] = self.State(tensor.numel())
        state.to(tensor.device)
        return state

    def fold_residual(self, key: int | str, tensor: Tensor, rank: int, n: int) -> None:
        """Hand bucket ``key``'s error-feedback residual to the route the bucket takes next (``compression="auto"``
        switched its codec): add it to ``tensor``, this rank's values about to be averaged over the ``n`` ranks of
        the group (this one ``rank``), and forget the bucket's state. What the residual held back then reaches
        the mean on this step instead of the next one this codec would have coded."""
        state = self.states.pop(key, None)
        residual = getattr(state, "residual", None)
        if residual is not None and residual.numel() == self.residual_numel(tensor.numel()):
            tensor.add_(residual[: tensor.numel()].to(tensor.dtype).view_as(tensor))

    def residual_numel(self, numel: int) -> int:
        """Elements of the residual this codec keeps for a tensor of ``numel`` (a codec may keep it padded)."""
        return numel

    @hookimpl
    def on_fold_residual(self, key: int | str, tensor: Tensor, rank: int, size: int) -> bool:
        self.fold_residual(key, tensor, rank, size)
        return True

    # -------------------------------------------------------------- tries that may be discarded

    @hookimpl
    def on_cross_node_try(self, bucket: Bucket) -> None:
        # A copy of the bucket's state (its residuals: as much memory again, kept from try to try): a sync redone
        # after a failed try then codes its pseudo-gradients from the same residuals, not on top of what the failed
        # try left of them.
        key = state_key(bucket)
        if key not in self._before:
            state = self.states.get(key)
            self._before[key] = None if state is None else state.copy(into=self._spare.pop(key, None))

    @hookimpl
    def on_cross_node_settled(self, applied: bool) -> None:
        before, self._before = self._before, {}
        for key, kept in before.items():
            if applied:
                if kept is not None:
                    self._spare[key] = kept
                continue
            discarded = self.states.pop(key, None)
            if kept is not None:
                self.states[key] = kept
            if discarded is not None:
                self._spare[key] = discarded

    # -------------------------------------------------------------- members that come and go

    @hookimpl
    def on_member_state(self) -> dict[str, Any]:
        # A returning member receives the state every rank shares (PowerSGD's Q and its count of steps, which
        # decides when compression starts), so that its collectives are its peers' from its first step on; its
        # per-rank state (error-feedback residuals) starts from zero, as on a resume with another world size.
        # (Fault tolerance reads it on a live member at the quorum of a step whose codec does not run: a member
        # heals in it, the cross stage is then the plain all-reduce, so the states are the last commit's.)
        return {self._key: {key: state.state_dict() for key, state in self.states.items()}}

    @hookimpl
    def on_load_member_state(self, state: Mapping[str, Any]) -> None:
        saved = state.get(self._key)
        if saved is None:
            return
        self.states = {}
        for key, shared in saved.items():
            restored = self.states[key] = self.State(shared["numel"])
            restored.load_state_dict(shared)

    @hookimpl
    def on_member_sync_state(self) -> dict[str, Any]:
        # (with a sync mode a codec codes only the syncs: its shared state changes only inside one)
        return self.on_member_state()

    @hookimpl
    def on_load_member_sync_state(self, state: Mapping[str, Any]) -> None:
        self.on_load_member_state(state)

    # -------------------------------------------------------------- checkpoints

    @property
    def _key(self) -> str:
        return f"codec/{self.name}"

    @hookimpl
    def on_save_state_dict(self) -> dict[str, Any] | None:
        if not self.State.shared:
            return None
        return {self._key: {index: state.state_dict() for index, state in self.states.items()}}

    @property
    def keeps_rank_state(self) -> bool:
        """Whether this codec's per-rank fields are in use (the same answer on every rank)."""
        return bool(self.State.per_rank)

    @hookimpl
    def on_save_rank_state_dict(self) -> dict[str, Any] | None:
        if not self.keeps_rank_state:
            return None
        return {self._key: {index: state.rank_state_dict() for index, state in self.states.items()}}

    @hookimpl
    def on_load_state_dict(self, state: Mapping[str, Any], rank_state: Mapping[str, Any] | None) -> None:
        shared, mine = state.get(self._key), (rank_state or {}).get(self._key)
        if isinstance(shared, Mapping) and "ranks" in shared:
            shared, mine = _legacy(shared)
        if shared is None and mine is None:
            return
        if mine is None and self.keeps_rank_state:
            log.warning("ddp_plugin %s codec: the checkpoint was saved by another number of ranks; per-rank state"
                        " (error-feedback residuals) starts from zero, shared state (%s) is kept.",
                        self.name, ", ".join(self.State.shared) or "none")
        self.states = {}
        for index in {*(shared or {}), *(mine or {})}:
            common, own = (shared or {}).get(index) or {}, (mine or {}).get(index) or {}
            numel = common.get("numel", own.get("numel"))
            if numel is None:
                continue
            restored = self.states[_saved_key(index)] = self.State(numel)
            restored.load_state_dict(common)
            restored.load_rank_state_dict(own)


def state_key(bucket: Bucket) -> int | str:
    """Where a codec keeps a bucket's state: its index for gradient buckets (as checkpoints have always held it),
    ``"<kind>/<index>"`` for others (a sync mode's pseudo-gradients: error feedback per fragment and bucket)."""
    return bucket.index if bucket.kind == "gradients" else f"{bucket.kind}/{bucket.index}"


def _saved_key(key: Any) -> int | str:
    return int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else key


def _legacy(saved: Mapping[str, Any]) -> tuple[dict[int, Any], dict[int, Any] | None]:
    """A checkpoint of the first layout, ``{"world_size": n, "ranks": [every rank's per-bucket dict]}``: shared
    fields from rank 0, this rank's own where the world size still matches."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    shared = saved["ranks"][0]
    mine = saved["ranks"][rank] if saved["world_size"] == world else None
    return shared, mine
