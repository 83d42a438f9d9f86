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

import contextlib
import sys
from collections.abc import Callable, Collection, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # (torch's own way to see every operation)
from torch.utils._pytree import tree_leaves, tree_map_only

from ddp_plugin.hookspecs import hookimpl, local_tensor
from ddp_plugin.runtime.storage import unallocated


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (or is a DTensor whose shard is)."""
    return any(local_tensor(t).is_meta for t in _tensors(module))


def materialize(module: nn.Module, device: torch.device, seed_offset: int = 0,
                deferred: Collection[nn.Parameter] = ()) -> Deferred | None:
    """Allocate ``module``'s meta parameters and buffers on ``device`` and initialize them (module docstring);
    tensors already allocated are left as they are (a layer ``configure_model`` built for real stays as built).
    ``TypeError`` naming every module that cannot be initialized, before anything is allocated.

    Each tensor keeps its identity (its storage is swapped in, ``torch.utils.swap_tensors``): tied parameters stay
    one parameter, and whatever holds a reference to one (the strategy's record of the pipeline's tied copies)
    holds the materialized one. ``to_empty`` would make a new parameter per module that uses it.

    The initializers draw from the default generators reseeded with ``seed_offset`` added to their seed (the
    rank), and restored after: tensor-parallel shards initialized alike would start every shard of a matrix
    equal (on CPU, DTensor's random ops draw each shard from the local generator), a symmetry training never
    breaks. The strategy then starts every replica from the first one's values.

    ``deferred``: parameters moved to ``device`` without memory (:func:`unallocated`), for a ZeRO stage 3 sharder
    to allocate unit by unit; the returned :class:`Deferred` initializes each group of them once they hold memory
    (``None`` without any)."""
    pending = _initializers(module)
    later = {id(p) for p in deferred if local_tensor(p).is_meta}
    fresh: set[int] = set()
    for sub in module.modules():
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is None or id(t) in fresh or not local_tensor(t).is_meta:
                continue
            empty = torch.empty_like(t, device=device)
            if id(t) in later:
                local_tensor(empty).untyped_storage().resize_(0)  # (one parameter's memory at a time, given back)
            torch.utils.swap_tensors(t, nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter)
                                     else empty)
            fresh.add(id(t))
    init = Deferred(module, pending, device, seed_offset)
    init.run(guarded=bool(later))  # (writes to the parameters left without memory skipped)
    return init if later else None


class Deferred:
    """The initialization of the parameters :func:`materialize` left without memory, group by group, as a ZeRO
    stage 3 sharder gives them memory (each unit's parameters in its flat buffer; the hook
    ``on_initialize_parameters``), so that no rank holds more than a unit of whole parameters at a time.

    For each group the model's initializers run again, and only the group is written: an operation that would
    write any other tensor (one initialized already, a unit sharded already, one without memory yet) is skipped,
    and one that reads a tensor without memory runs on the meta device (:class:`_WritesTo`). The random
    generators continue from one group to the next (their state is kept between calls, the caller's restored
    after each), so the units draw different values, as in one initialization. ``sync`` then makes the group's
    replicas equal (the strategy's module-state broadcast, over these tensors only)."""

    def __init__(self, module: nn.Module, initializers: list, device: torch.device, seed_offset: int) -> None:
        self.module = module
        self.initializers = initializers
        self.sync: Callable[[Sequence[torch.Tensor]], None] | None = None
        self.groups = 0
        """Groups initialized so far (one per ZeRO unit)."""
        self._cuda = [device] if device.type == "cuda" else []
        self._states: list[torch.Tensor] | None = None
        self._seed_offset = seed_offset

    def run(self, only: Collection[torch.Tensor] | None = None, guarded: bool = True) -> None:
        """Run every initializer once, under this object's generators (seeded from the caller's seed plus the
        offset the first time), writing only the memory of ``only`` (default: every tensor that has memory;
        without ``guarded``, every tensor: nothing is left without memory)."""
        guard = _WritesTo(only) if guarded else contextlib.nullcontext()
        with torch.random.fork_rng(devices=self._cuda), torch.no_grad(), guard:
            generators = [torch.default_generator, *(torch.cuda.default_generators[d.index or 0] for d in self._cuda)]
            if self._states is None:
                for generator in generators:
                    generator.manual_seed(generator.initial_seed() + self._seed_offset)
            else:
                for generator, state in zip(generators, self._states):
                    generator.set_state(state)
            for init in self.initializers:
                init()
            self._states = [g.get_state() for g in generators]

    @hookimpl
    def on_initialize_parameters(self, params: Sequence[nn.Parameter]) -> bool:
        self.run(only=params)
        if self.sync is not None:
            self.sync(list(params))
        self.groups += 1
        return True


class _WritesTo(TorchDispatchMode):
    """Operations may write only the memory of ``only`` (``None``: any tensor that has memory); other writes are
    skipped (the tensor is returned as it was), and an operation that reads a tensor without memory runs on the
    meta device instead."""

    def __init__(self, only: Collection[torch.Tensor] | None) -> None:
        super().__init__()
        self.storages = None if only is None else {_storage(t) for t in only}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = args[i] if i < len(args) else kwargs.get(argument.name)
            if isinstance(target, torch.Tensor) and not self._writable(target):
                return target
        if any(isinstance(t, torch.Tensor) and unallocated(t) for t in tree_leaves((args, kwargs))):
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: torch.empty_like(t, device="meta") if unallocated(t) else t, (args, kwargs))
        return func(*args, **kwargs)

    def _writable(self, t: torch.Tensor) -> bool:
        if local_tensor(t).is_meta:
            return True
        if unallocated(t):
            return False
        return self.storages is None or _storage(t) in self.storages


def _storage(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage().data_ptr()


def _initializers(root: nn.Module) -> list:
    """The calls that initialize ``root``'s meta tensors, outermost first: ``init_weights`` of a module that defines
    one (its subtree is then covered), else ``reset_parameters`` of each module with meta tensors of its own."""
    calls, missing = [], []
    # (a loop, not a recursive closure: a closure that calls itself is a reference cycle, which would hold `calls`,
    # and so the modules, until a garbage collection; the split by time drops each block's copy as it goes)
    pending = [("", root)]
    while pending:
        name, module = pending.pop()
        if not any(local_tensor(t).is_meta for t in _tensors(module)):
            continue
        init_weights = getattr(module, "init_weights", None)
        if _is_transformers_model(module):
            # Its own initialization without its `tie_weights` (which would look for the embedding on a stage
            # that left it out): tied parameters are one parameter here, and their stages' copies made equal.
            init_weights = module.initialize_weights
        if callable(init_weights):
            calls.append(init_weights)
            continue
        own = [t for t in _tensors(module, recurse=False) if local_tensor(t).is_meta]
        if own:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                calls.append(reset)
            else:
                missing.append(f"`{name or '(the root module)'}` ({type(module).__name__})")
        pending += [(f"{name}.{child_name}" if name else child_name, child)
                    for child_name, child in reversed(list(module.named_children()))]  # (popped in order)
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
