"""Materializing a module built on the meta device: what ``trainer.init_module(empty_init=True)`` builds with this
strategy (as with Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy``), so that no rank allocates what it
will not keep. The strategy materializes in ``setup``, after the module is split into pipeline stages and its
``configure_model`` has parallelized it, and before ZeRO shards it: each rank allocates only what it holds.

Initializing, in torchtitan's and Lightning's conventions: a module that defines ``init_weights()`` initializes
its whole subtree (torchtitan's models; the place to rebuild non-persistent buffers such as rotary tables); any
other module with parameters or buffers of its own is reset by its ``reset_parameters()`` (Lightning's
``_materialize_distributed_module``, torch's layers). A module with neither fails, naming it: its values would be
uninitialized memory. Values are then made equal across replicas by the strategy's usual start (every rank from
the first replica's parameters and buffers), and tied copies by its ties.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import nn

from ddp_plugin.hookspecs import local_tensor


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (or is a DTensor whose shard is)."""
    return any(local_tensor(t).is_meta for t in _tensors(module))


def materialize(module: nn.Module, device: torch.device, seed_offset: int = 0) -> None:
    """Allocate ``module``'s meta parameters and buffers on ``device`` and initialize them (module docstring);
    tensors already allocated are left as they are (a layer ``configure_model`` built for real stays as built).
    ``TypeError`` naming every module that cannot be initialized, before anything is allocated.

    Each tensor keeps its identity (its storage is swapped in, ``torch.utils.swap_tensors``): tied parameters stay
    one parameter, and whatever holds a reference to one (the strategy's record of the pipeline's tied copies)
    holds the materialized one. ``to_empty`` would make a new parameter per module that uses it.

    The initializers draw from the default generators reseeded with ``seed_offset`` added to their seed (the
    rank), and restored after: tensor-parallel shards initialized alike would start every shard of a matrix
    equal (on CPU, DTensor's random ops draw each shard from the local generator), a symmetry training never
    breaks. The strategy then starts every replica from the first one's values."""
    pending = _initializers(module)
    fresh: set[int] = set()
    for sub in module.modules():
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is None or id(t) in fresh or not local_tensor(t).is_meta:
                continue
            empty = torch.empty_like(t, device=device)
            torch.utils.swap_tensors(t, nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter)
                                     else empty)
            fresh.add(id(t))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for d in ("cpu", *([device] if devices else [])):
            generator = torch.default_generator if d == "cpu" else torch.cuda.default_generators[device.index or 0]
            generator.manual_seed(generator.initial_seed() + seed_offset)
        for init in pending:
            init()


def _initializers(root: nn.Module) -> list:
    """The calls that initialize ``root``'s meta tensors, outermost first: ``init_weights`` of a module that defines
    one (its subtree is then covered), else ``reset_parameters`` of each module with meta tensors of its own."""
    calls, missing = [], []

    def visit(name: str, module: nn.Module) -> None:
        if not any(local_tensor(t).is_meta for t in _tensors(module)):
            return
        init_weights = getattr(module, "init_weights", None)
        if _is_transformers_model(module):
            # Its own initialization without its `tie_weights` (which would look for the embedding on a stage
            # that left it out): tied parameters are one parameter here, and their stages' copies made equal.
            init_weights = module.initialize_weights
        if callable(init_weights):
            calls.append(init_weights)
            return
        own = [t for t in _tensors(module, recurse=False) if local_tensor(t).is_meta]
        if own:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                calls.append(reset)
            else:
                missing.append(f"`{name or '(the root module)'}` ({type(module).__name__})")
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", root)
    if missing:
        raise TypeError(
            f"`trainer.init_module(empty_init=True)` built the model on the meta device, and {', '.join(missing)}"
            " cannot be initialized there: it holds parameters or buffers but defines no `reset_parameters()`, and"
            " neither it nor a module above it defines `init_weights()`. Its values would be uninitialized memory."
            " Define `reset_parameters()` on it (or `init_weights()` on the model, initializing every parameter"
            " and buffer), or build the model without `empty_init=True`."
        )
    return calls


def _is_transformers_model(module: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # (never imported here: a model of it has imported it)
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def _tensors(module: nn.Module, recurse: bool = True) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)
