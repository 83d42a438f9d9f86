"""The gradient engine: flat bucket buffers, readiness during backward, ordered launch, and the sync point.

The engine knows nothing about how a bucket is reduced; it hands each ready bucket to the
``on_bucket_ready`` hook and waits on the future it gets back.

(About 420 lines: one class, because the readiness hooks, the ordered launch, the bound on the buckets in the
communication thread's hands and the sync point share the state of one backward.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddp_plugin import health
from ddp_plugin.runtime.clock import Clock
from ddp_plugin.runtime.finite import finite_flag
from ddp_plugin.runtime.storage import unallocated
from ddp_plugin.runtime.streams import SideThread
from ddp_plugin.hookspecs import Bucket, completed_future, is_tensor_parallel_shard, local_tensor, set_local_grad

if TYPE_CHECKING:
    import concurrent.futures
    from pluggy import HookRelay
    from torch import Tensor
    from torch.nn import Module, Parameter

    from ddp_plugin.hookspecs import Communicator

log = logging.getLogger(__name__)


FIRST_BUCKET_BYTES = 2**20


def pack(
    named_params: Iterable[tuple[str, Parameter]], cap_bytes: int, first_cap_bytes: int | None = None
) -> list[list[tuple[str, Parameter]]]:
    """Group parameters into buckets of at most ``cap_bytes`` (a single larger parameter gets its own bucket),
    in the order given, never mixing dtypes or devices, nor tensor-parallel shards with replicated parameters:
    a replicated parameter's bucket is then the same on every rank of a tensor-parallel group, and a codec that
    codes a bucket as a whole (int8's block scales) gives them the same bits, so the copies stay identical.

    ``first_cap_bytes`` caps the first bucket only. DDP uses 1 MiB there: the first bucket is the first one
    ready in backward, and a small one starts communication early instead of after a quarter of backward."""
    groups: list[list[tuple[str, Parameter]]] = []
    current: list[tuple[str, Parameter]] = []
    current_bytes = 0
    for name, p in named_params:
        nbytes = local_tensor(p).numel() * p.element_size()
        cap = cap_bytes if groups or first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
        if current and (
            _kind(p) != _kind(current[0][1]) or current_bytes + nbytes > cap
        ):
            groups.append(current)
            current, current_bytes = [], 0
        current.append((name, p))
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def _kind(p: Parameter) -> tuple[torch.dtype, torch.device, bool]:
    return p.dtype, p.device, is_tensor_parallel_shard(p)


def build_buckets(
    named_params: Iterable[tuple[str, Parameter]],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
    groups: Iterable[Iterable[tuple[str, Parameter]]] | None = None,
    pad_multiple: int = 1,
    device: torch.device | None = None,
) -> list[Bucket]:
    """Buckets for ``named_params`` packed by :func:`pack`, or for the given ``groups`` (one bucket each, in
    order). Each parameter's gradient becomes a view into its bucket's buffer; an existing gradient is copied
    in. Buffers are zero-padded to a multiple of ``pad_multiple`` elements, so a sharder can split every
    bucket into equal shards without copying (the padding stays zero and belongs to no parameter).

    Parameters without memory yet (a model built on meta, left for a ZeRO stage 3 sharder to allocate unit by
    unit: ``materialize.unallocated``) get their bucket's buffer on ``device``, released at once (a bucket is
    allocated on its first gradient): the buffers of a model no rank holds are never all allocated together."""
    groups = [list(g) for g in groups] if groups is not None else pack(named_params, cap_bytes, first_cap_bytes)
    for group in groups:
        if len({(p.dtype, p.device) for _, p in group}) > 1:
            raise ValueError(f"A bucket mixes dtypes or devices: {[n for n, _ in group]}")

    buckets = []
    for index, group in enumerate(groups):
        offsets, total = [], 0
        for _, p in group:
            offsets.append(total)
            total += local_tensor(p).numel()
        first = group[0][1]
        deferred = unallocated(first) and device is not None
        buffer = torch.zeros(-(-total // pad_multiple) * pad_multiple, dtype=first.dtype,
                             device=device if deferred else first.device)
        bucket = Bucket(
            index=index,
            buffer=buffer,
            params=tuple(p for _, p in group),
            names=tuple(n for n, _ in group),
            offsets=tuple(offsets),
        )
        if deferred:
            bucket.release()
        for i, p in enumerate(bucket.params):
            if p.grad is not None:
                view = bucket.grad_view(i)
                view.copy_(local_tensor(p.grad))
                set_local_grad(p, view)
        buckets.append(bucket)
    return buckets


def _grad_views(bucket: Bucket) -> list[Tensor]:
    """Each parameter's gradient view of ``bucket`` (a released buffer is allocated for the while: a view is
    checked against its memory)."""
    released = bucket.released
    bucket.materialize()
    views = [bucket.grad_view(i) for i in range(len(bucket.params))]
    if released:
        bucket.release()
    return views


def _check_plan(named: list[tuple[str, Parameter]], planned: Iterable[Iterable[tuple[str, Parameter]]]) -> None:
    expected = {id(p) for _, p in named}
    seen = [id(p) for group in planned for _, p in group]
    if len(seen) != len(set(seen)) or set(seen) != expected:
        raise ValueError("`on_plan_buckets` must return every trainable parameter exactly once.")


RELEASED_IN_FLIGHT = 1
"""Buckets a synchronizing backward may leave in the communication thread's hands before it allocates a released
one again (:meth:`GradientEngine._bound_released_in_flight`)."""


class GradientEngine:
    """Synchronizes the gradients of ``module`` during backward.

    - Every trainable parameter's gradient lives in a flat bucket buffer; buckets follow reverse registration
      order, the order in which backward produces gradients, so the first bucket is ready first.
    - A post-accumulate-grad hook per parameter counts readiness. A full bucket is launched at once, but only
      after every bucket before it: all ranks launch buckets in the same order whatever order their autograd
      produced gradients in.
    - Launching means calling ``on_bucket_ready`` on a single communication thread, so collectives are issued
      in one order on every rank, overlap the rest of backward, and a multi-stage codec may wait between its
      collectives without stalling backward. On CUDA that thread queues its work on a stream of its own (as
      DDP's reducer and FSDP do), so a codec's waits hold back only the communication, never the backward's
      kernels: a bucket is handed over with an event recorded on the backward's stream after its last gradient
      (the communication stream waits for it), its buffer is marked as used by the communication stream
      (``record_stream``: the allocator keeps it until that stream is done with it), and at the sync point the
      training stream waits for the communication stream before anything reads the gradients.
    - At the end of backward (an autograd callback, with ``finish()`` as a fallback) the engine launches what
      is left (parameters that got no gradient contribute zeros), agrees with the other ranks on which
      parameters got a gradient anywhere, waits for every bucket, and leaves ``.grad = None`` on parameters no
      rank used, exactly as single-process training would.

    While ``require_sync`` is False (inner steps of gradient accumulation) gradients accumulate into the
    buffers and nothing is communicated.
    """

    def __init__(
        self,
        module: Module,
        hook: HookRelay,
        bucket_cap_bytes: int,
        flags_group: dist.ProcessGroup,
        device: torch.device,
        comm: Communicator,
        pad_multiple: int = 1,
        shared_replicas: tuple[int, dist.ProcessGroup] | None = None,
        solo: Iterable[Parameter] = (),
    ) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        solo = [p for p in solo if p.requires_grad]
        planned = hook.on_plan_buckets(module=module, named_params=named, cap_bytes=bucket_cap_bytes, solo=solo)
        if planned is not None:
            _check_plan(named, planned)
        if solo and planned is None:
            # Parameters that several pipeline stages hold (a tied embedding) get buckets of their own, first:
            # each stage's copy is then reduced alone, under the same index, and every copy gets the same bits.
            names = {id(p): n for n, p in named}
            alone = {id(p) for p in solo}
            planned = [[(names[id(p)], p)] for p in solo] + pack(
                [(n, p) for n, p in reversed(named) if id(p) not in alone], bucket_cap_bytes, FIRST_BUCKET_BYTES)
        self.buckets: list[Bucket] = build_buckets(
            reversed(named), bucket_cap_bytes, FIRST_BUCKET_BYTES, groups=planned, pad_multiple=pad_multiple,
            device=device,
        )
        self.require_sync = True
        self.check_finite = False
        self.nonfinite = False
        """After a synchronizing backward with ``check_finite``: whether any rank had a NaN/Inf gradient."""
        self._hook = hook
        self.flags_group: dist.ProcessGroup | None = flags_group
        """Bookkeeping (which parameters got a gradient) runs on a group of its own, so gloo moves it alongside the
        last bucket instead of queueing it behind, and it never interleaves with the plugins' collectives. The
        ranks the step's gradients are averaged over: the session points it at a node's group for the steps whose
        gradients stay inside the node; ``None``: this rank alone."""
        self._comm = comm
        self._owner: dict[int, int] = {}
        """With tensor parallelism at stage 0 (``shared_replicas``: the tensor-parallel size and a group of this
        rank's tensor-parallel peers for the communication thread): bucket index -> the tensor-parallel rank that
        reduces that bucket of replicated parameters over its data-parallel ranks, then broadcasts the mean to its
        peers inside the node. Every peer holds the same gradient for a replicated parameter, so one copy crosses
        the slow link instead of one per peer: a node sends the whole model's gradient once, as without tensor
        parallelism. The owners take turns over such buckets."""
        self._peers = shared_replicas[1] if shared_replicas is not None else None
        if shared_replicas is not None:
            replicated = [b.index for b in self.buckets if not is_tensor_parallel_shard(b.params[0])]
            self._owner = {index: turn % shared_replicas[0] for turn, index in enumerate(replicated)}
        self._views: list[list[Tensor]] = [_grad_views(b) for b in self.buckets]
        self._params: list[Parameter] = [p for b in self.buckets for p in b.params]
        self._flat_views: list[Tensor] = [v for views in self._views for v in views]
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_grad_hook(b.index, i))
            for b in self.buckets
            for i, p in enumerate(b.params)
        ]
        self._pending = [0] * len(self.buckets)
        self._next_launch = 0
        self._in_flight: list[concurrent.futures.Future] = []
        self._armed = False
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.buckets[0].buffer.device
                                      if self.buckets else device)
        """With ``check_finite``: whether a bucket launched in this backward held a NaN/Inf, kept on the device
        (a host read per bucket would stall the CPU on CUDA); read once, at the sync point."""
        self.clock = Clock(device)
        self._thread = SideThread(device, "ddp_plugin-comm")
        self._side = self._thread.side
        """The communication thread's CUDA stream (see ddp_plugin.runtime.streams)."""

    # ------------------------------------------------------------------ backward

    def _make_grad_hook(self, b: int, i: int):
        view = self._views[b][i]
        bucket = self.buckets[b]

        def on_grad_accumulated(p: Parameter) -> None:
            if bucket.released:  # a sharder released the buffer after its reduction
                self._bound_released_in_flight()
                bucket.materialize()
            grad = local_tensor(p.grad)
            if grad.data_ptr() != view.data_ptr():
                # The first backward after zero_grad(set_to_none=True) allocated a fresh gradient.
                view.copy_(grad)
                set_local_grad(p, view)
            if not self.require_sync:
                return
            if not self._armed:
                self._arm()
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._launch_ready()

        return on_grad_accumulated

    def _bound_released_in_flight(self) -> None:
        """Before a released bucket is allocated again in a synchronizing backward: wait until at most
        :data:`RELEASED_IN_FLIGHT` of the buckets launched are still being reduced. A sharder releases each bucket
        once its shard is reduced, so the buckets alive are the one filling and those the communication thread has
        not reached; when it falls behind the backward (a slow link, a codec, a step in backward), they would pile
        up, each a unit's gradients at ZeRO-3 (FSDP2 likewise lets one reduce-scatter run ahead). The thread never
        idles for it: it is still reducing the buckets waited behind."""
        if not self._armed:
            return
        undone = [f for f in self._in_flight if not f.done()]
        if len(undone) > RELEASED_IN_FLIGHT:
            with health.diagnosed():
                for submitted in undone[: len(undone) - RELEASED_IN_FLIGHT]:
                    health.wait(submitted)

    def _arm(self, at_end_of_backward: bool = True) -> None:
        self._armed = True
        self._pending = [len(b.params) for b in self.buckets]
        self._next_launch = 0
        self._in_flight = []
        self._nonfinite.zero_()
        if at_end_of_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def synchronize(self, first: Sequence[Parameter] = (), between: Callable[[], None] | None = None) -> None:
        """Synchronize the gradients accumulated so far (with ``require_sync`` False) as a synchronizing backward
        would at its end: every bucket reduced, unused parameters agreed on. For a backward the engine did not
        watch (a pipeline schedule's microbatches); outside of autograd. The buckets of the parameters ``first``
        are reduced ahead of the others (in the same order on every rank), and ``between`` is called once they
        are, while the others still are (a pipeline's tied gradient crosses the link then)."""
        self._arm(at_end_of_backward=False)
        had_grad = [p.grad is not None for p in self._params]  # (before the fill-up, which keeps None as None)
        wanted = {id(p) for p in first}
        early = [b for b in self.buckets if any(id(p) in wanted for p in b.params)]
        for bucket in early + [b for b in self.buckets if b not in early]:
            self._launch_pending(bucket)
        self._next_launch = len(self.buckets)
        self.finish(between=between, early=len(early), had_grad=had_grad)

    def gradient_shard(self, bucket: Bucket) -> tuple[int, Tensor] | None:
        """Once ``bucket`` is reduced in a sync: the part of its mean a sharder keeps on this rank, ``(offset,
        tensor)``, or ``None`` where the bucket holds the whole mean (the hook ``on_gradient_shard``)."""
        return self._hook.on_gradient_shard(bucket=bucket)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        if self.check_finite:
            # Checked before the reduction (a codec could turn a NaN into a finite value on the wire), on the
            # device (ddp_plugin.runtime.finite.finite_flag: no host read).
            self._nonfinite.logical_or_(finite_flag(bucket.buffer).logical_not_())
        # (On CUDA: past this bucket's last gradient and the check above, on the backward's stream.)
        ready = self._side.hand_over(bucket.buffer)
        self._in_flight.append(self._thread.submit(self._reduce, bucket, ready))
        self._next_launch = bucket.index + 1

    def _reduce(self, bucket: Bucket, ready: torch.cuda.Event | None = None) -> torch.futures.Future:
        self._side.receive(ready)
        owner = self._owner.get(bucket.index)
        if owner is not None:  # a bucket of replicated parameters under tensor parallelism (see _owner)
            if dist.get_rank(self._peers) == owner:
                self._reduce_over_data_parallel_ranks(bucket).wait()
            self._comm.broadcast(bucket.buffer, src=owner, group=self._peers)
            return completed_future()
        return self._reduce_over_data_parallel_ranks(bucket)

    def _reduce_over_data_parallel_ranks(self, bucket: Bucket) -> torch.futures.Future:
        fut = self._hook.on_bucket_ready(bucket=bucket)
        if fut is None:
            raise RuntimeError(
                f"No plugin answered `on_bucket_ready` for bucket {bucket.index}; a reducer plugin must be"
                " registered (the strategy registers the flat reducer by default)."
            )
        return fut

    def _launch_pending(self, bucket: Bucket) -> None:
        """Launch ``bucket``, its gradients that did not arrive filled in: zeros for a parameter without one, a
        copy into the bucket for one that is not its view."""
        if self._pending[bucket.index] != 0:
            bucket.materialize()
            for i, p in enumerate(bucket.params):
                view = self._views[bucket.index][i]
                if p.grad is None:
                    view.zero_()
                elif local_tensor(p.grad).data_ptr() != view.data_ptr():
                    view.copy_(local_tensor(p.grad))
                    set_local_grad(p, view)
        self._launch(bucket)

    def finish(self, between: Callable[[], None] | None = None, early: int = 0,
               had_grad: list[bool] | None = None) -> None:
        """The sync point: launch what is left, wait for every bucket, fix up unused parameters. With ``between``:
        called once the first ``early`` buckets launched are reduced, before waiting for the others.
        ``had_grad``: which parameters had a gradient before the buckets were filled up (default: as they are now).

        Runs at the end of a synchronizing backward; a no-op when nothing is armed."""
        if not self._armed:
            return
        self._armed = False
        # Which parameters got a gradient on this rank; taken before the fill-up below, which keeps None as None.
        flags = had_grad if had_grad is not None else [p.grad is not None for p in self._params]
        for bucket in self.buckets[self._next_launch :]:
            self._launch_pending(bucket)

        # Agree with the other ranks on which parameters got a gradient anywhere (and, with check_finite, whether
        # any rank saw a NaN/Inf): one small all-reduce on the bookkeeping group, which gloo runs beside the
        # bucket reductions. The same collective runs on every rank every step, so ranks whose data skipped a
        # branch cannot hang.
        flags.append(False)
        counts = torch.tensor(flags, dtype=torch.int32, device=self.buckets[0].buffer.device)
        counts[-1] = self._nonfinite  # (device to device)
        flags_work = (self._comm.all_reduce(counts, group=self.flags_group, async_op=True)
                      if self.flags_group is not None else None)

        waiting_since = self.clock.stamp()
        try:
            # A peer died or hung: say which one, rather than gloo's "Connection closed by peer [ip]:port".
            with health.diagnosed():
                for submitted in self._in_flight[:early]:
                    health.wait(health.wait(submitted))
                if between is not None:
                    self._side.join()  # (on CUDA: past the early buckets' reductions, and what is queued)
                    between()
                for submitted in self._in_flight[early:]:
                    health.wait(health.wait(submitted))
                if flags_work is not None:
                    flags_work.wait()
        finally:
            self._in_flight = []
        self._side.join()
        # How long the training stream waited for the communication past its own work (on CUDA between two
        # events of that stream; the host waits for the second one here, as it would reading the flags below).
        sync_wait_s = self.clock.elapsed(waiting_since, self.clock.stamp(), wait=True)

        # A parameter some rank used holds the mean (zeros from the ranks that did not use it were averaged
        # in); one no rank used has no gradient at all, so optimizers skip it as they would in one process.
        *used, nonfinite = counts.tolist()
        self.nonfinite = nonfinite > 0
        start = 0
        for bucket in self.buckets:
            bucket.grad_used = [bool(c) for c in used[start : start + len(bucket.params)]]
            start += len(bucket.params)
        for p, view, count in zip(self._params, self._flat_views, used):
            # A plugin that released a bucket (a ZeRO sharder keeps only its shard) owns those gradients now.
            if not (count and view.untyped_storage().nbytes()):
                p.grad = None
            elif p.grad is None or local_tensor(p.grad).data_ptr() != view.data_ptr():
                set_local_grad(p, view)
        self._hook.on_after_backward(buckets=self.buckets, sync_wait_s=sync_wait_s)

    # ------------------------------------------------------------------ lifecycle

    def remove(self, failed: bool = False) -> None:
        """Remove the autograd hooks and stop the communication thread; after a ``failed`` fit without waiting
        for it (it may be inside a collective with a rank that is gone: see ddp_plugin.runtime.streams)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._thread.close(wait=not failed)
