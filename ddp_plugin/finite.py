"""Whether a tensor holds only finite values, without a tensor-sized temporary.

``torch.isfinite(t).all()`` builds ``|t|`` and two boolean masks on the way (measured on CPU: 1.5 times the
tensor's bytes allocated per call), and it runs on every bucket of every step (``skip_nonfinite``, the codecs'
error-feedback guards). The largest magnitude is finite exactly when every value is (a NaN or an infinity makes
it NaN or infinite), and ``vector_norm(t, inf)`` reduces to it in one pass with nothing allocated but the result.
"""

from __future__ import annotations

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no value of ``tensor`` is NaN or infinite (integer tensors always are finite)."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    return bool(torch.isfinite(torch.linalg.vector_norm(tensor, float("inf"))))
