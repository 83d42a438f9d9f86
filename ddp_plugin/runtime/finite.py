"""Whether a tensor holds only finite values, without a tensor-sized temporary.

``torch.isfinite(t).all()`` builds ``|t|`` and two boolean masks on the way (measured on CPU: 1.5 times the
tensor's bytes allocated per call), and it runs on every bucket of every step (``skip_nonfinite``, the codecs'
error-feedback guards). The smallest and largest values are both finite exactly when every value is (a NaN makes
them NaN, an infinity one of them infinite), and ``aminmax`` finds them in one pass with nothing allocated but the
two results: on CPU 8 times faster than ``vector_norm(t, inf)``, which did the same before (4M float32 values on
one thread: 1.7-1.9 ms against 15 ms, a PowerSGD bucket's residual check every step). Complex tensors, which have
no order, still take the norm.
"""

from __future__ import annotations

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no value of ``tensor`` is NaN or infinite (integer tensors always are finite)."""
    return bool(finite_flag(tensor))


def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`all_finite` as a 0-dim bool tensor on ``tensor``'s device, for code that must not wait for an
    accelerator: turning the answer into a Python bool (``bool``, ``if``) blocks the host until the device has
    computed it, where a flag handed on to device operations (``masked_fill_``, ``torch.where``) does not."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.is_complex():
        return torch.isfinite(torch.linalg.vector_norm(tensor, float("inf")))
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low).logical_and_(torch.isfinite(high))


def zero_unless(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero ``tensor`` in place unless ``keep`` (a 0-dim bool tensor on its device, :func:`finite_flag`'s say)
    holds; returns ``tensor``. On an accelerator the host never reads ``keep``: a ``masked_fill_`` with it as a
    broadcast mask, one pass over the tensor in stream order. On the CPU reading it waits for nothing, and
    zeroing only when needed saves that pass (measured on CPU: ``masked_fill_`` takes several times
    an ``add_`` of the same tensor)."""
    if tensor.device.type == "cpu":
        if not keep:
            tensor.zero_()
        return tensor
    return tensor.masked_fill_(keep.logical_not(), 0)


def zero_if_not_finite(tensor: torch.Tensor) -> torch.Tensor:
    """Zero ``tensor`` in place when any of its values is NaN or infinite; returns it. Without the host waiting
    for an accelerator (see :func:`zero_unless`); on the CPU with :func:`all_finite`, as before."""
    if tensor.device.type == "cpu":
        if not all_finite(tensor):
            tensor.zero_()
        return tensor
    return zero_unless(tensor, finite_flag(tensor))
