"""Activation checkpointing (the ``activation_checkpointing_policy`` flag, in the terms of Lightning's
``FSDPStrategy``): the modules of the named classes keep only their inputs from the forward and run it again in
the backward, through torch's own non-reentrant ``torch.utils.checkpoint.checkpoint`` (with the random state
of the forward, so dropout draws the same mask again).

The module's ``forward`` is replaced on the instance, not wrapped in another module: parameter and state-dict
names stay as they are (torch's ``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module.`` into every name,
which the checkpoint keys, the pipeline's stage plans and the tensor-parallel plans would all have to strip), and
hooks registered on the module (ZeRO-3's gathers, the tensor-parallel input and output conversions, the failure
diagnosis's whereabouts) run as before, around the recomputed forward. Without gradients (validation,
prediction) the forward runs as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddp_plugin.parallel.module_classes import Entries, as_entries, class_names, containers, matches, unmatched


def check_policy(policy: Any) -> Entries | None:
    """None -> off; module classes, or their names (for YAML), one or several -> those."""
    if policy is None:
        return None
    items = as_entries(policy)
    if items is None:
        raise ValueError(
            f"`activation_checkpointing_policy={policy!r}` is not supported; allowed values: None (off), or module"
            " classes (or their names, e.g. ['TransformerBlock']) whose forward is recomputed in the backward."
        )
    if names := containers(items):
        raise ValueError(
            f"`activation_checkpointing_policy` names {', '.join(names)}, a container whose forward is never called"
            " (its parent calls its children); name the class of the modules it holds instead (e.g. your"
            " transformer block)."
        )
    return items


def check_present(module: nn.Module, policy: Entries) -> None:
    """Every entry of ``policy`` names a module of ``module`` (the whole model, before a pipeline split)."""
    if missing := unmatched(module.modules(), policy):
        raise ValueError(
            f"`activation_checkpointing_policy` names {missing[0]!r}, which matches no module of"
            f" {type(module).__name__}; its module classes are: {', '.join(class_names(module))}."
        )


class CheckpointedForward:
    """The ``forward`` of a module whose activations are recomputed in the backward. An object rather than a
    closure, so that a deep copy of the module calls its own forward."""

    def __init__(self, module: nn.Module, inner: Any = None) -> None:
        self.module = module
        self.inner = inner  # a forward set on the instance before this one, else None (the class's)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def apply(module: nn.Module, policy: Entries) -> list[str]:
    """Checkpoint every module of ``module`` that ``policy`` names (outermost only: one inside a checkpointed
    module is recomputed with it already). Idempotent (a second ``fit``). Returns their names."""
    done: list[str] = []
    for name, m in module.named_modules():
        if any(name.startswith(outer + ".") for outer in done):
            continue
        if matches(m, policy):
            if not is_checkpointed(m):
                m.forward = CheckpointedForward(m, m.__dict__.get("forward"))
            done.append(name)
    return done
