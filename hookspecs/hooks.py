"""Hook specifications: the whole protocol between the strategy and its plugins.

The strategy calls every hook with keyword arguments; an implementation may accept any subset of a hook's
parameters (pluggy passes only the ones it names). Register an implementation by decorating a method or
function with :data:`ddp_plugin.hookimpl` and handing the object to the strategy (``plugins=[...]``), or by
declaring an entry point in the group ``ddp_plugin`` of an installed package.

Ordering: pluggy calls the most recently registered implementation first; built-in defaults are registered
first and marked ``trylast`` so any plugin of yours overrides them. For ``firstresult`` hooks the first
implementation that returns something other than ``None`` answers and the rest are not called.

Threads: ``on_bucket_ready`` and ``on_cross_node_reduce`` run on the engine's communication thread, one bucket
at a time in bucket order, the same order on every rank. An implementation may therefore issue several
collectives one after the other, and even wait between them (PowerSGD's two all-reduces with an
orthogonalization between), without any risk of ranks issuing collectives in different orders. It must not
issue collectives from future callbacks (``.then``), which run on arbitrary threads: that is how torch's own
PowerSGD hook aborts on gloo with several buckets. Every other hook runs on the training thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddp_plugin.hookspecs import hookspec

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import torch
    from pluggy import HookRelay
    from torch import Tensor
    from torch.distributed import ProcessGroup
    from torch.nn import Module, Parameter
    from torch.optim import Optimizer

    from ddp_plugin.hookspecs.types import Bucket, Topology


# -------------------------------------------------------------------------
# Setup and teardown
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def on_plan_buckets(
    module: Module, named_params: Sequence[tuple[str, Parameter]], cap_bytes: int
) -> Sequence[Sequence[tuple[str, Parameter]]] | None:
    """Decide which parameters share a gradient bucket, or return ``None`` to let the engine pack them (reverse
    registration order, ``cap_bytes`` per bucket, a small first bucket, as DDP does).

    A ZeRO stage 3 sharder answers with one bucket per wrapped unit, so a unit's gradients are reduced and its
    gathered parameters freed as soon as backward is done with it. Return the groups in launch order (the
    order backward finishes them); parameters must be ``named_params``' own and each appear exactly once.

    Stops at first non-None result.

    :param module: the user's LightningModule.
    :param named_params: the trainable parameters, in registration order, without duplicates (tied
        parameters appear once).
    :param cap_bytes: the ``bucket_size_mb`` flag in bytes.
    """


@hookspec
def on_setup(
    topology: Topology, buckets: Sequence[Bucket], hook: HookRelay, options: Mapping[str, Any], module: Module
) -> None:
    """Called once per ``fit``, after the process groups exist and the engine has built its buckets, before the
    optimizers are created and before the first forward.

    :param topology: where this rank sits, with the world, intra-node and inter-node process groups.
    :param buckets: every gradient bucket, in launch order. Plugins may keep references; the buffers live
        until teardown.
    :param hook: the hook relay, for plugins that call other hooks (a reducer calls
        ``hook.on_cross_node_reduce(...)``).
    :param options: the strategy's flags as given by the user (``compression``, ``compression_options``,
        ``bucket_size_mb``, ``zero_stage``, ...), read-only.
    :param module: the user's LightningModule, on its device, with every rank holding rank 0's parameters.
    """


@hookspec
def on_setup_optimizer(optimizer: Optimizer) -> None:
    """Called once per optimizer that ``configure_optimizers`` returned, right after the strategy set it up and
    before training. A sharder re-points the optimizer's parameter groups at this rank's shard here; it must
    keep the optimizer object and its ``param_groups`` dicts, so learning-rate schedulers keep working.
    Raise here (before any step) for an optimizer the plugin cannot handle, saying which and why.
    """


@hookspec
def on_teardown() -> None:
    """Called once at the end of ``fit`` (also after an exception). Release threads and handles, but keep what
    ``on_save_state_dict`` returns: ``trainer.save_checkpoint`` after ``fit`` still asks for it."""


# -------------------------------------------------------------------------
# Backward: gradient synchronization
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def on_bucket_ready(bucket: Bucket) -> torch.futures.Future | None:
    """Start synchronizing one bucket; return a future that completes when ``bucket.buffer`` holds the mean of
    the gradients over all ranks.

    Fired by the engine during backward as soon as every gradient in the bucket has been accumulated (buckets
    are launched strictly in ``bucket.index`` order, so a bucket that is ready early waits for its
    predecessors), and at the end of backward for buckets whose parameters got no gradient. The engine waits
    on every returned future before the optimizer step.

    Stops at first non-None result. The reducer plugins (flat, hierarchical) implement it; a ``wrapper=True``
    implementation may observe or time it.

    :param bucket: the bucket; write the result into ``bucket.buffer`` in place.
    """


@hookspec(firstresult=True)
def on_cross_node_reduce(tensor: Tensor, group: ProcessGroup, bucket: Bucket) -> torch.futures.Future | None:
    """Average ``tensor`` in place over the ranks of ``group``, the stage of synchronization that crosses the
    slow link; return a future that completes when ``tensor`` holds the mean.

    The reducer calls it with the part of the bucket this rank is responsible for across nodes (the whole
    bucket for the flat reducer). Codecs implement it and choose their own collectives: integers cannot be
    summed by all-reduce, so an int8 codec all-gathers, PowerSGD runs two all-reduces. The built-in default
    (registered ``trylast``) divides by the group size and all-reduces.

    Stops at first non-None result.

    :param tensor: 1-D, contiguous; the mean must be written into it in place.
    :param group: the process group to average over (may have a single rank).
    :param bucket: the bucket the tensor belongs to, for per-bucket codec state (``bucket.state``).
    """


@hookspec
def on_after_backward(buckets: Sequence[Bucket], sync_wait_s: float) -> None:
    """Called on the training thread at the end of a backward that synchronizes gradients, after every
    bucket's future has completed: the gradients in ``bucket.buffer`` are the global means.

    Not called for the inner backward passes of gradient accumulation, which do not synchronize.

    :param buckets: every bucket, in launch order.
    :param sync_wait_s: seconds the training thread waited at the end of backward for communication that
        had not finished yet (communication hidden behind backward does not count).
    """


# -------------------------------------------------------------------------
# Optimizer step
# -------------------------------------------------------------------------


@hookspec
def on_pre_optimizer_step(optimizer: Optimizer) -> None:
    """Called after the closure (forward and backward, gradients synchronized) and before ``optimizer.step``
    updates the parameters. Lightning's own gradient clipping runs after this hook.

    :param optimizer: the user's optimizer (the same object ``configure_optimizers`` returned).
    """


@hookspec(firstresult=True)
def on_clip_grad_norm(optimizer: Optimizer, max_norm: float) -> Tensor | None:
    """Clip the gradients ``optimizer`` is about to apply so that their global 2-norm is at most ``max_norm``,
    and return the norm before clipping; or ``None`` to leave it to Lightning (``torch.nn.utils.clip_grad_norm_``
    over the optimizer's parameters).

    Called for ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` and the strategy's own
    ``gradient_clip_norm``. A sharder answers: each rank holds only its shard of the gradients, so the norm
    needs one all-reduce of the squared norms. Stops at first non-None result.
    """


@hookspec
def on_gather_full_parameters(gather: bool) -> None:
    """With ``gather=True``: make every module parameter hold its full value on this rank (a stage 3 sharder
    all-gathers the units it freed); with ``False``: free them again. Called on every rank, by
    ``HierarchicalZeroStrategy.full_parameters()`` (to read the parameters, e.g. for a checkpoint); changes
    made to parameters meanwhile are not kept.
    """


@hookspec
def on_gather_full_gradients(gather: bool) -> None:
    """Lend every module parameter its full gradient, or take it back.

    Called by ``HierarchicalZeroStrategy.full_gradients()`` on entry (``gather=True``) and on exit (``False``),
    on every rank, from the training thread. With ``True``, a plugin that keeps only shards of the gradients
    (a ZeRO stage 2/3 sharder) all-gathers them so that each module parameter's ``.grad`` holds the whole
    gradient the optimizer is about to apply (the global mean after a synchronizing backward, clipped once
    clipping ran), ``None`` where the optimizer has none; with ``False`` it frees them and restores each
    ``.grad`` as it was. Gradients lent are read-only: changes are not applied. Plugins whose module gradients
    are whole anyway (stages 0 and 1) do nothing.

    Not firstresult: every implementation is called. Runs collectives on every rank with ``gather=True``
    (side groups, training thread); none with ``False``.

    :param gather: ``True`` to lend the full gradients, ``False`` to take them back.
    :returns: nothing.
    """


@hookspec(firstresult=True)
def on_grad_norms(module: Module, norm_type: float) -> dict[str, Tensor] | None:
    """Return the ``norm_type``-norm of the full gradient of every parameter of ``module`` that has one, keyed
    by the name ``module.named_parameters()`` gives it, without gathering the gradients; or ``None`` when
    ``.grad`` is whole and ``lightning.pytorch.utilities.grad_norm`` can read it (stages 0 and 1).

    Called by ``HierarchicalZeroStrategy.grad_norm()`` on every rank, from the training thread. A sharder
    answers with the per-parameter sums of ``|g|^p`` (maxima of ``|g|`` for ``inf``) of its shards, summed
    over the ranks by one all-reduce of two numbers per parameter.

    Stops at first non-None result. An implementation that answers runs a collective on every rank.

    :param module: the user's LightningModule.
    :param norm_type: ``p`` of the p-norm, a positive float or ``inf``.
    :returns: ``{parameter name: norm}`` (0-d tensors), or ``None``.
    """


@hookspec
def on_after_optimizer_step(optimizer: Optimizer) -> None:
    """Called right after ``optimizer.step``. A sharder gathers the updated parameters here. Not called for a
    step that ``skip_nonfinite`` skipped (the parameters did not change).

    :param optimizer: the user's optimizer.
    """


# -------------------------------------------------------------------------
# Metrics
# -------------------------------------------------------------------------


@hookspec
def on_collect_metrics() -> dict[str, float] | None:
    """Return metrics about the optimizer step that just ended, as ``{name: value}``, or ``None``.

    Called on the training thread after every optimizer step. The strategy logs the merged dict through the
    Trainer's loggers (every ``log_every_n_steps``) and prints the per-step means at the end of ``fit`` on
    rank 0. Use a ``prefix/name`` (e.g. ``comm/cross_node_MB``) and report this rank's own values.
    """


# -------------------------------------------------------------------------
# Checkpoints
# -------------------------------------------------------------------------


@hookspec
def on_save_state_dict() -> dict[str, Any] | None:
    """Return the state this plugin needs to continue after a resume, as ``{key: state}``, or ``None``.

    Plugin state is declared, never scraped: whatever is not returned here is lost on resume. Keys must be
    unique across plugins (use the plugin's name); the strategy stores the merged dict under
    ``checkpoint["ddp_plugin"]`` and refuses duplicate keys.
    """


@hookspec(firstresult=True)
def on_module_state_dict(module: Module) -> dict[str, Any] | None:
    """Return the module's full state dict for a checkpoint, or ``None`` for ``module.state_dict()``. Called on
    every rank (a sharder gathers); only global rank 0's answer is written. Stops at first non-None result."""


@hookspec(firstresult=True)
def on_optimizer_state_dict(optimizer: Optimizer) -> dict[str, Any] | None:
    """Return ``optimizer``'s state for a checkpoint in the layout the unsharded optimizer would have (so any
    world size, stage or plain Lightning can resume from it), or ``None`` for ``optimizer.state_dict()``. Called
    on every rank; only global rank 0's answer is written. Tensors that must be gathered may be returned as
    :class:`~ddp_plugin.hookspecs.DeferredTensor`\\ s, produced one storage at a time while rank 0 writes; a
    rank whose producers take part must return them too (the strategy runs them on every rank in the order
    they were made). Stops at first non-None result."""


@hookspec(firstresult=True)
def on_load_optimizer_state_dict(optimizer: Optimizer, state_dict: Mapping[str, Any]) -> bool | None:
    """Load an unsharded-layout optimizer state dict into ``optimizer``; return True when done, or ``None`` to
    let ``optimizer.load_state_dict`` do it. Raise a clear error for a state that does not fit. Stops at first
    non-None result."""


@hookspec(firstresult=True)
def on_local_module_state_dict(module: Module) -> dict[str, Any] | None:
    """For ``checkpoint="sharded"``: return this rank's part of the module state as flat keys, a tensor every
    rank holds whole under its name and a piece of a sharded one as ``<name>#<start>`` (the 1-D slice of the
    flattened tensor that starts at element ``start``); or ``None`` for ``module.state_dict()``. Called on every
    rank; no communication is needed. Stops at first non-None result."""


@hookspec(firstresult=True)
def on_local_optimizer_state_dict(optimizer: Optimizer) -> dict[str, Any] | None:
    """For ``checkpoint="sharded"``: return this rank's part of ``optimizer``'s state as ``{"state": {flat key:
    value}, "param_groups": [...], "shapes": {...}}``, parameters numbered as in the unsharded
    ``optimizer.state_dict()``, keys ``<index>/<state key>`` or ``<index>/<state key>#<start>`` for a piece, and
    ``shapes`` giving the full shape of every key cut into pieces, or of its parameter (``<index>``), on every rank
    whether or not it holds a piece; or ``None`` for the unsharded state. Stops at first non-None result."""


@hookspec
def on_load_state_dict(state: Mapping[str, Any]) -> None:
    """Restore plugin state from a checkpoint, after ``on_setup``.

    :param state: the merged dict every plugin's ``on_save_state_dict`` returned at save time; take your key.
    """
