"""The communicator with ``fault_tolerance``: the strategy's own, plus the collectives of a codec across replica
groups, on torchft's process group of this group rank.

That process group is torchft's (reconfigured over the live groups at each quorum), not one of this Lightning
world's: ``torch.distributed`` knows neither its ranks nor its peers. A collective on it is issued on the group
itself, every byte it sends counted as crossing nodes (its peers are other replica groups), and a failure (a peer
died inside it) is handed to torchft's Manager instead of raised: the step or sync is then committed nowhere, as
with torchft's own all-reduce, and the collectives after it in that quorum are skipped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from ddp_plugin.runtime.comm import nbytes

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.runtime.comm import TracedCommunicator

log = logging.getLogger(__name__)


class ReplicaGroupCommunicator:
    """The strategy's communicator ``inner`` (a :class:`~ddp_plugin.runtime.comm.TracedCommunicator`), whose
    collectives on ``cross`` (torchft's process group, ``manager``'s) run on that group as torchft's own do:
    counted as cross-node bytes, failures reported to ``manager``. Every other collective is ``inner``'s."""

    def __init__(self, inner: TracedCommunicator, cross: Any, manager: Any) -> None:
        self.inner = inner
        self.cross = cross
        self.manager = manager

    def count_allreduce(self, tensors: list[Tensor]) -> None:
        """Count what torchft's own all-reduce of ``tensors`` (issued through its Manager) sends from this rank."""
        self.inner.count_bytes(0, _ring_bytes(self.cross.size(), tensors))

    def _issue(self, start: Any, output: Tensor, sends: float, async_op: bool) -> Any:
        n = self.cross.size()
        work = None
        if n == 1 or self.manager.errored():  # (alone: the output is the input; else skipped: zeros, see _Guarded)
            work = _Guarded(None, output if n == 1 else output.zero_(), self.manager)
        if work is None:
            self.inner.count_bytes(0, sends)
            release = getattr(self.cross, "release", None)
            try:
                work = _Guarded(start(), output, self.manager, release=release)
            except Exception as err:  # noqa: BLE001 - torchft's rule: a failed collective fails the step
                work = _Guarded(None, output, self.manager, err, release=release)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, piece_bytes=None):
        if group is not self.cross:
            return self.inner.all_reduce(tensor, op, group, async_op, piece_bytes)
        opts = AllreduceOptions()
        opts.reduceOp = op
        return self._issue(lambda: self.cross.allreduce([tensor], opts), tensor,
                           _ring_bytes(self.cross.size(), [tensor]), async_op)

    def all_gather(self, output, input, group=None, async_op=False):  # noqa: A002
        if group is not self.cross:
            return self.inner.all_gather(output, input, group, async_op)
        n = self.cross.size()
        chunks = list(output.view(-1).split(input.numel()))
        return self._issue(lambda: self.cross.allgather([chunks], [input.reshape(-1)], AllgatherOptions()),
                           output, (n - 1) * nbytes(input), async_op)

    def all_to_all(self, output, input, group=None, async_op=False):  # noqa: A002
        if group is not self.cross:
            return self.inner.all_to_all(output, input, group, async_op)
        n = self.cross.size()
        return self._issue(lambda: self.cross.alltoall_base(output, input, [], [], AllToAllOptions()), output,
                           (n - 1) / n * nbytes(input), async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        if group is self.cross:
            raise NotImplementedError("broadcast across replica groups (no built-in codec runs one)")
        return self.inner.broadcast(tensor, src, group, async_op)

    def reduce_scatter(self, output, input, group=None):  # noqa: A002
        if group is self.cross:
            raise NotImplementedError("reduce_scatter across replica groups (torchft's gloo group has none)")
        return self.inner.reduce_scatter(output, input, group)

    # (the rest of the contract, and the strategy's extras, are the inner communicator's)

    def new_group(self, ranks=None, backend=None):
        return self.inner.new_group(ranks, backend)

    def bytes_sent_by_this_thread(self) -> int:
        return self.inner.bytes_sent_by_this_thread()

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.inner.scratch(numel, dtype, device)

    def release_scratch(self) -> None:
        self.inner.release_scratch()

    def take_traffic(self) -> Any:
        return self.inner.take_traffic()

    def count_sends(self, group: Any, sends: list[tuple[int, float]]) -> None:
        self.inner.count_sends(group, sends)

    def count_bytes(self, intra: float, cross: float) -> None:
        self.inner.count_bytes(intra, cross)


def _ring_bytes(n: int, tensors: list[Tensor]) -> float:
    """What a ring all-reduce of ``tensors`` over ``n`` ranks sends from each: 2(n-1)/n of them."""
    return sum(2 * (n - 1) / n * nbytes(t) for t in tensors)


class _Guarded:
    """A collective's work on torchft's group: waiting never raises. A failure is reported to the Manager (the
    quorum's step or sync will not commit) and the output is then zeros, as is a skipped collective's: whatever a
    codec decodes of it is thrown away with the quorum, but decoding must not fail, and a failed all-gather's
    output holds some peers' payloads and leftover bytes, which the sparse codec read as indices far outside its
    chunks (found under churn: four groups stopped with "index out of bounds"). Zeros decode as nothing in every
    built-in codec (the sparse one keeps an index past its chunk, which zeros give, in it). ``work=None``: skipped
    (one rank alone, or an earlier collective of the quorum failed), or failed to start with ``error``."""

    def __init__(self, work: Any, output: Tensor, manager: Any, error: Exception | None = None,
                 release: Any = None) -> None:
        self.work, self.output, self.manager, self.release = work, output, manager, release
        if error is not None:
            self._failed(error)

    def _failed(self, err: Exception) -> None:
        log.warning("ddp_plugin: a collective across replica groups failed (%s); this quorum's step is committed"
                    " nowhere", err)
        self.manager.report_error(err)
        self.output.zero_()
        if self.release is not None:
            self.release()  # (the peers waiting on this rank fail at once: see UniqueRendezvous.release)

    def wait(self) -> bool:
        if self.work is not None:
            try:
                self.work.wait()
            except Exception as err:  # noqa: BLE001
                self._failed(err)
            self.work = None
        return True

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.output)
        return fut
