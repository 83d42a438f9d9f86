"""Hook specifications: the whole protocol between the strategy and its plugins.

(One file of about 660 lines on purpose: a plugin author learns the whole protocol from it, as from pytest's
``hookspec.py``; it is almost all documentation.)

The strategy calls every hook with keyword arguments; an implementation may accept any subset of a hook's
parameters (pluggy passes only the ones it names, and an implementation's parameter must not have a default).
Register an implementation by decorating a method or function with :data:`ddp_plugin.hookimpl` and handing
the object to the strategy (``plugins=[...]``), or by declaring an entry point in the group ``ddp_plugin`` of
an installed package.

Ordering: pluggy calls the most recently registered implementation first; built-in defaults are registered
first and marked ``trylast`` so any plugin of yours overrides them. For ``firstresult`` hooks the first
implementation that returns something other than ``None`` answers and the rest are not called.

Threads: ``on_bucket_ready`` and ``on_cross_node_reduce`` run on the engine's communication thread, one bucket
at a time in bucket order, the same order on every rank (``on_cross_node_reduce`` of a sync mode's
pseudo-gradients, ``bucket.kind == "pseudo_gradient"``, runs on the sync mode's own thread, over groups of its
own, one at a time in the same order on every rank; they are offered only when a plugin answers ahead of the
plain mean, which the sync mode computes itself from its sharded outer state). An implementation may therefore issue several
collectives one after the other, and even wait between them (PowerSGD's two all-reduces with an
orthogonalization between), without any risk of ranks issuing collectives in different orders. It must not
issue collectives from future callbacks (``.then``), which run on arbitrary threads: that is how torch's own
PowerSGD hook aborts on gloo with several buckets. Every other hook runs on the training thread, and a
collective issued there goes on a ``side_*`` group of the topology (the communication thread owns the others).

Collectives: a hook whose entry says "collective" is called on every rank at the same point, so an
implementation may run collectives in it (through the :class:`~ddp_plugin.hookspecs.Communicator` handed to
``on_setup``, which counts their traffic); one that says "local" must not.

Built-in implementers named below: the engine's reducers (``FlatReducer``, ``HierarchicalReducer``, under
a link plan ``AdaptivePlanner``, the hierarchical reducer that follows the plan, and with ``fault_tolerance`` the
hierarchical reducer with the cross stage ``ReplicaGroupCrossStage``, which runs over the live replica groups
through torchft: its all-reduce, or with a built-in codec ``on_cross_node_reduce`` on torchft's process group),
the default cross-node mean
(``MeanAllReduce``), the codecs (``ddp_plugin.codecs``) and, with ``compression="auto"``, ``AutoCodec`` (it answers
``on_cross_node_reduce`` first and calls the codec the plan names, alone, through hooks of its own), the ZeRO sharder (``ddp_plugin.zero.ZeroSharder``), the sync modes
(``ddp_plugin.sync.OuterSync``; with ``fault_tolerance`` its transport ``ReplicaGroupTransport``, whose
pseudo-gradients cross replica groups the same way, and which hands over a group's place in the schedule), the
traffic accounting (``TrafficAccounting``) and the initializer of a model built
on the meta device (``ddp_plugin.parallel.materialize.Deferred``).

Ranks: the bucket hooks' collectives (``on_bucket_ready``, ``on_cross_node_reduce``) span data-parallel ranks
only. With tensor parallelism the topology's groups are those of this rank's tensor-parallel position (the ranks
holding the same shard), with pipeline stages those of this rank's stage; a stage's shared parameter
(``bucket.kind == "tied_gradient"``) is summed over the group of its copies across the stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddp_plugin.hookspecs import hookspec

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import torch
    from ddp_plugin.hookspecs.types import Bucket, Communicator, Options, ParameterShards, Topology
    from pluggy import HookRelay
    from torch import Tensor
    from torch.distributed import ProcessGroup
    from torch.nn import Module, Parameter
    from torch.optim import Optimizer


# -------------------------------------------------------------------------
# Setup and teardown
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def on_plan_buckets(
    module: Module, named_params: Sequence[tuple[str, Parameter]], cap_bytes: int, solo: Sequence[Parameter]
) -> Sequence[Sequence[tuple[str, Parameter]]] | None:
    """Decide which parameters share a gradient bucket, or let the engine pack them (reverse registration
    order, ``cap_bytes`` per bucket, a small first bucket, as DDP does).

    Called once per ``fit`` when the engine is built, before ``on_setup``. Local. Stops at first non-None
    result. Implemented by the ZeRO sharder at stage 3 (one bucket per wrapped unit, so a unit's gradients are
    reduced and its gathered parameters freed as soon as backward is done with it).

    :param module: the user's LightningModule.
    :param named_params: the trainable parameters, in registration order, without duplicates (tied
        parameters appear once).
    :param cap_bytes: the ``bucket_size_mb`` flag in bytes.
    :param solo: parameters that several pipeline stages hold (a tied embedding); give each a bucket of its own
        where you can, so its copies' sum runs on matching shards (``on_gradient_shard``); otherwise the
        copies' whole gradients are summed before the sync.
    :returns: the groups of ``(name, parameter)`` in launch order (the order backward finishes them), each
        parameter of ``named_params`` exactly once; or ``None`` for the engine's packing.
    """


@hookspec
def on_setup(
    topology: Topology, buckets: Sequence[Bucket], hook: HookRelay, options: Options, module: Module,
    comm: Communicator,
) -> None:
    """Called once per ``fit``, after the process groups exist and the engine has built its buckets, before the
    optimizers are created and before the first forward. Collective (creating a process group is allowed).

    Implemented by every built-in plugin that keeps per-fit state.

    :param topology: where this rank sits, with the world, intra-node and inter-node process groups.
    :param buckets: every gradient bucket, in launch order. Plugins may keep references; the buffers live
        until teardown.
    :param hook: the hook relay, for plugins that call other hooks (a reducer calls
        ``hook.on_cross_node_reduce(...)``).
    :param options: the strategy's settings, validated (:class:`~ddp_plugin.hookspecs.Options`); a third-party
        codec reads its ``compression_options`` here.
    :param module: the user's LightningModule, on its device, with every rank holding rank 0's parameters (at
        ZeRO stage 3 with a model built on the meta device, its trainable parameters are still on meta here: the
        sharder gives them memory and has them initialized, ``on_initialize_parameters``).
    :param comm: the collectives to use (:class:`~ddp_plugin.hookspecs.Communicator`): they count traffic
        and their groups honour the strategy's ``timeout``.
    :returns: nothing.
    """


@hookspec(firstresult=True)
def on_initialize_parameters(params: Sequence[Parameter]) -> bool | None:
    """Initialize ``params``: parameters of a model built on the meta device
    (``trainer.init_module(empty_init=True)``) that the strategy left there for a sharder, which has just given
    them memory (uninitialized, on the rank's device). Afterwards they hold the model's initial values, the same
    on every data-parallel replica.

    Called by the ZeRO sharder at stage 3, once per bucket (a unit's parameters) while it lays the buckets out in
    ``on_setup``, in bucket order, so that no rank holds more than one unit of whole parameters at a time.
    Collective (the replicas are made equal). Stops at first non-None result. Implemented by the strategy's
    initializer (:class:`ddp_plugin.parallel.materialize.Deferred`) in a ``fit`` whose model was built on the meta
    device at stage 3; without it no parameter reaches a plugin on the meta device.

    :param params: the parameters, now holding memory.
    :returns: ``True`` once they are initialized; ``None`` when no implementation initializes them.
    """


@hookspec(firstresult=True)
def on_parameter_shards() -> ParameterShards | None:
    """This rank's part of every bucket's flat parameters, to read and write in place between optimizer steps
    (:class:`~ddp_plugin.hookspecs.ParameterShards`).

    Called after ``on_setup`` (by a sync mode, which keeps its outer state for this rank's part only). Local.
    Stops at first non-None result. Implemented by the ZeRO sharder at node scope (its shards).

    :returns: the parts; or ``None`` when no plugin shards the parameters inside a node (the module's
        parameters are whole, and the caller splits them itself).
    """


@hookspec
def on_setup_optimizer(optimizer: Optimizer) -> None:
    """Called once per optimizer that ``configure_optimizers`` returned, right after the strategy set it up and
    before training. Local.

    Implemented by the ZeRO sharder, which re-points the optimizer's parameter groups at this rank's shard;
    it keeps the optimizer object and its ``param_groups`` dicts, so learning-rate schedulers keep working.
    Raise here (before any step) for an optimizer the plugin cannot handle, saying which and why.

    :param optimizer: the user's optimizer (the object ``configure_optimizers`` returned).
    :returns: nothing.
    """


@hookspec
def on_teardown(failed: bool) -> None:
    """Called once at the end of ``fit``, also after an exception. Collective when the fit ended normally
    (a stage 3 sharder gathers the parameters back). Release threads and handles, but keep what the state hooks
    need: ``trainer.save_checkpoint`` after ``fit`` still asks for it.

    :param failed: the fit raised. Then run no collective (a peer may be gone or stopped: a collective with it
        would wait out the timeout before the error reaches the user) and do not wait for a thread that may be
        inside one; the process is about to end.
    :returns: nothing.
    """


@hookspec(firstresult=True)
def on_gradient_scope() -> str | None:
    """Over which ranks the coming training step averages its gradients, when that is not every rank.

    ``"node"``: the step's gradients stay inside the node, each node a replica of its own (a sync mode's steps
    between its cross-node syncs). The strategy then keeps the step's own bookkeeping inside the node as well,
    so that nothing crosses nodes on such a step: which parameters got a gradient anywhere, the batch sizes of
    ``weighting="sample"``, and the buffers broadcast from the node's first rank. (With ``skip_nonfinite`` the
    bookkeeping still spans every rank, so that every replica skips the same steps.)

    Called on the training thread before each training step (each micro-batch of gradient accumulation).
    Local. Stops at first non-None result. Implemented by the sync modes' ``OuterSync``.

    :returns: ``"node"``; or ``None`` when the step's gradients are averaged over every rank (the default).
    """


# -------------------------------------------------------------------------
# Backward: gradient synchronization
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def on_bucket_ready(bucket: Bucket) -> torch.futures.Future | None:
    """Start synchronizing one bucket: make ``bucket.buffer`` hold the mean of the gradients over all ranks.

    Fired by the engine during backward as soon as every gradient in the bucket has been accumulated (buckets
    are launched strictly in ``bucket.index`` order, so a bucket that is ready early waits for its
    predecessors), and at the end of backward for buckets whose parameters got no gradient. The engine waits
    on every returned future before the optimizer step. Communication thread; collective.

    Stops at first non-None result. Implemented by the reducers (``trylast``) and, ahead of them, the ZeRO
    sharder (which reduces to this rank's shard only); ``TrafficAccounting`` wraps it (``wrapper=True``).

    :param bucket: the bucket; write the result into ``bucket.buffer`` in place.
    :returns: a future that completes when the bucket is reduced.
    """


@hookspec(firstresult=True)
def on_cross_node_reduce(
    tensor: Tensor, group: ProcessGroup, bucket: Bucket, offset: int
) -> torch.futures.Future | None:
    """Average ``tensor`` in place over the ranks of ``group``: the stage of synchronization that crosses the
    slow link.

    The reducer calls it with the part of the bucket this rank is responsible for across nodes (the whole
    bucket for the flat reducer, this rank's 1/k of it for the hierarchical one). Codecs implement it and
    choose their own collectives: integers cannot be summed by all-reduce, so an int8 codec all-gathers,
    PowerSGD runs two all-reduces. Communication thread; collective over ``group``. Also called, when a codec
    answers it, with a parameter's gradient that several pipeline stages hold (``bucket.kind ==
    "tied_gradient"``, over the group of its copies' ranks, on the training thread: at ZeRO stages 0-2 while the
    stage's other buckets are reduced, at stage 3 before the sync): every rank of ``group`` must get the same
    bits back.

    Stops at first non-None result. Implemented by the codecs and, as the default (``trylast``),
    ``MeanAllReduce`` (divide by the group size, all-reduce); ``TrafficAccounting`` wraps it.

    :param tensor: 1-D, contiguous; the mean must be written into it in place.
    :param group: the process group to average over (may have a single rank). With ``fault_tolerance``, torchft's
        process group across the live replica groups, which ``torch.distributed`` does not know: only the
        ``comm`` of ``on_setup`` runs collectives on it (a failure there is torchft's: it is not raised, and the
        step is committed nowhere), and ``dist.get_world_size(group)`` gives its size.
    :param bucket: the bucket the tensor belongs to, for per-bucket codec state.
    :param offset: where ``tensor[0]`` sits in ``bucket.buffer`` (elements), so that a codec can tell which
        parameters the tensor holds (``bucket.offsets``); elements past the end of the buffer are padding
        (zeros).
    :returns: a future that completes when ``tensor`` holds the mean.
    """


@hookspec(firstresult=True)
def on_fold_residual(key: int | str, tensor: Tensor, rank: int, size: int) -> bool | None:
    """Hand the error-feedback residual this codec keeps for bucket ``key`` to the route the bucket takes now
    (``compression="auto"`` switched the bucket's codec or route): add it to ``tensor``, this rank's values about to
    be averaged over the ``size`` ranks of a group (this one ``rank``), and forget the bucket's state, so that what
    the residual held back reaches the mean on this step. Called by ``AutoCodec`` and the link plan's reducer on the
    codec the bucket leaves alone (through hooks of its own, none of the other plugins'), on the communication
    thread. Local. Implemented by the built-in codecs.

    :returns: ``True`` once handed over; ``None`` when the codec keeps it (applied when the bucket takes the codec
        again).
    """


@hookspec
def on_cross_node_try(bucket: Bucket) -> None:
    """The ``on_cross_node_reduce`` of ``bucket`` that follows may be discarded: it crosses replica groups
    (``fault_tolerance``), and a group lost inside the step or sync makes every group skip it, a sync being redone
    from the same values. Keep what that reduction changes of your state for the bucket (a codec's error-feedback
    residuals, PowerSGD's Q, counts) as it is now, until ``on_cross_node_settled``. Called before each such
    reduction, on the thread that runs it (a bucket may come again in the same try: keep its first state). Local.
    """


@hookspec
def on_cross_node_settled(applied: bool) -> None:
    """The reductions announced by ``on_cross_node_try`` since the last call were applied everywhere
    (``applied``: forget what you kept) or discarded (put your state for those buckets back as you kept it, so
    that a sync redone from the same values codes them as the first try would have, and a skipped step leaves
    nothing behind). Called on every rank after the commit decision of a step or sync that ran such a reduction,
    on the thread that commits. Local. A plugin that does not implement the pair keeps what a discarded try
    changed.
    """


@hookspec(firstresult=True)
def on_gradient_shard(bucket: Bucket) -> tuple[int, Tensor] | None:
    """The part of ``bucket``'s reduced gradient this rank keeps, where a plugin keeps only a part and released
    the bucket's buffer: ``(offset, tensor)``, ``tensor`` holding elements ``offset...`` of the bucket's mean; it
    is the tensor the optimizer steps with, so what is written into it in place is what the step uses. ``None``
    where ``bucket.buffer`` holds the whole mean.

    Asked on the training thread, between the reduction of ``bucket`` and the end of the sync, for the bucket of a
    parameter several pipeline stages hold (alone in its bucket): each rank then sums only its part with the same
    part of the other stages' copies, so the shared gradient crosses between the stages once per step instead of
    once per data-parallel rank. Local.

    Stops at first non-None result. Implemented by the ZeRO sharder at stages 2-3 (its shard).

    :param bucket: an engine bucket whose reduction has completed in this sync.
    :returns: ``(offset, tensor)``, or ``None``.
    """


@hookspec
def on_after_backward(buckets: Sequence[Bucket], sync_wait_s: float) -> None:
    """Called on the training thread at the end of a backward that synchronizes gradients, after every
    bucket's future has completed: the gradients in ``bucket.buffer`` are the global means (or, after a
    sharder's reduction, its shards are). Not called for the inner backward passes of gradient
    accumulation, which do not synchronize. Local.

    Implemented by the ZeRO sharder (hands the reduced shards to the optimizer) and ``TrafficAccounting``.

    :param buckets: every bucket, in launch order.
    :param sync_wait_s: seconds the training thread waited at the end of backward for communication that
        had not finished yet (communication hidden behind backward does not count).
    :returns: nothing.
    """


# -------------------------------------------------------------------------
# Optimizer step
# -------------------------------------------------------------------------


@hookspec
def on_pre_optimizer_step(optimizer: Optimizer) -> None:
    """Called after the closure (forward and backward, gradients synchronized) and before ``optimizer.step``
    updates the parameters; Lightning's own gradient clipping runs after this hook. Collective.

    No built-in implements it; it is for plugins that inspect or change gradients before the step.

    :param optimizer: the user's optimizer (the same object ``configure_optimizers`` returned).
    :returns: nothing.
    """


@hookspec
def on_before_optimizer_update(optimizer: Optimizer) -> None:
    """Called right before the optimizer's update: after the closure, Lightning's ``on_before_optimizer_step``
    hooks and gradient clipping (and a loss scaler's ``unscale_``). Collective.

    A plugin may apply the update itself here, e.g. bucket by bucket (the ZeRO sharder does with ``offload``),
    and drop the gradients it applied (``.grad = None``), so that the optimizer's own ``step`` skips them.

    :param optimizer: the user's optimizer.
    :returns: nothing.
    """


@hookspec(firstresult=True)
def on_clip_grad_norm(optimizer: Optimizer, max_norm: float) -> Tensor | None:
    """Clip the gradients ``optimizer`` is about to apply so that their global 2-norm is at most ``max_norm``.

    Called for ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` and the strategy's own
    ``gradient_clip_norm``. Collective. Stops at first non-None result. Implemented by the ZeRO sharder: each
    rank holds only its shard of the gradients, so the norm needs one all-reduce of the squared norms.

    :param optimizer: the user's optimizer.
    :param max_norm: the largest global 2-norm allowed.
    :returns: the global norm before clipping; or ``None`` to leave it to ``torch.nn.utils.clip_grad_norm_``
        over the optimizer's parameters.
    """


@hookspec
def on_gather_full_parameters(gather: bool) -> None:
    """Make every module parameter hold its full value on this rank, or free it again.

    Called by ``HierarchicalZeroStrategy.full_parameters()`` on entry (``gather=True``) and exit
    (``False``), on every rank. Collective with ``gather=True``. Implemented by the ZeRO sharder (stage 3
    all-gathers the units it freed). Changes made to the parameters meanwhile are not kept.

    :param gather: ``True`` to gather, ``False`` to free.
    :returns: nothing.
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

    Not firstresult: every implementation is called. Collective with ``gather=True`` (side groups, training
    thread); local with ``False``. Implemented by the ZeRO sharder.

    :param gather: ``True`` to lend the full gradients, ``False`` to take them back.
    :returns: nothing.
    """


@hookspec(firstresult=True)
def on_grad_norms(module: Module, norm_type: float) -> dict[str, Tensor] | None:
    """The ``norm_type``-norm of the full gradient of every parameter of ``module`` that has one, without
    gathering the gradients.

    Called by ``HierarchicalZeroStrategy.grad_norm()`` on every rank, from the training thread. Stops at first
    non-None result; an implementation that answers runs a collective on every rank. Implemented by the ZeRO
    sharder at stages 2-3: the per-parameter sums of ``|g|^p`` (maxima of ``|g|`` for ``inf``) of its shards,
    summed over the ranks by one all-reduce of two numbers per parameter.

    :param module: the user's LightningModule.
    :param norm_type: ``p`` of the p-norm, a positive float or ``inf``.
    :returns: ``{parameter name (as module.named_parameters() gives it): norm}`` (0-d tensors), or ``None`` when
        ``.grad`` is whole and ``lightning.pytorch.utilities.grad_norm`` can read it (stages 0 and 1).
    """


@hookspec
def on_after_optimizer_step(optimizer: Optimizer) -> None:
    """Called right after ``optimizer.step``. Collective. Not called for a step that ``skip_nonfinite``
    skipped (the parameters did not change).

    Implemented by the ZeRO sharder, which all-gathers the updated shards (stages 1-2) or frees the stale
    units (stage 3).

    :param optimizer: the user's optimizer.
    :returns: nothing.
    """


# -------------------------------------------------------------------------
# Members that come and go (fault tolerance)
# -------------------------------------------------------------------------
#
# A *member* is one replica of the model among several trained together whose set may change during a fit (with
# ``fault_tolerance``, a replica group: a lost one leaves, a returning one joins and receives the live ones' state).
# These hooks are the whole of what the strategy asks about it: the plugins that run a set of members (the built-in
# ones in ``ddp_plugin.fault_tolerance``) implement them, and every other plugin hands over and loads its own state.


@hookspec(firstresult=True)
def on_transport(comm: Communicator) -> Communicator | None:
    """The communicator of the fit, in place of ``comm``: a wrapper that also runs collectives on groups the
    strategy did not make (the members' own), counting their bytes. Called once per ``fit``, before the link
    probe and ``on_setup``, on the plugins the strategy was given (``plugins=``) and the fit's own. Local.
    Implemented by fault tolerance's plugin (collectives on torchft's process group across replica groups).

    :param comm: the strategy's communicator (:class:`~ddp_plugin.hookspecs.Communicator`).
    :returns: the communicator every plugin then receives in ``on_setup``; or ``None`` to keep ``comm``.

    Example::

        @hookimpl
        def on_transport(self, comm):
            return CountingWrapper(comm, self.members_group)
    """


@hookspec
def on_step_start() -> None:
    """A training step begins, before its forward: a plugin that decides whether the step commits
    (``on_commit_step``) starts asking the other members here (torchft's quorum runs while the forward does).
    Called on the training thread once per optimizer step's first micro-batch and again on later ones (start at
    most once per optimizer step). Local.
    """


@hookspec(firstresult=True)
def on_step_gated() -> bool | None:
    """Whether the coming optimizer step is applied only if ``on_commit_step`` says so. The strategy then runs
    the closure (forward, backward, gradient synchronization) first, asks ``on_commit_step``, and skips the
    optimizer's step on this rank when it answers ``False``. Called on the training thread before each optimizer
    step. Local.

    :returns: ``True`` to gate the step; ``None`` (or ``False``) to step as usual.
    """


@hookspec(firstresult=True)
def on_commit_step() -> bool | None:
    """Whether every member applies this optimizer step (its gradients are synchronized: one that failed to
    reach a member, or a member lost inside the step, makes every member skip it). Called on the training thread
    after the closure of a step ``on_step_gated`` gated, on every rank. Collective over the members (torchft's
    ``should_commit``); a joining member loads the live ones' state inside it (``on_load_member_state``).

    :returns: ``True`` (apply) or ``False`` (every rank of every member skips the step and zeroes its
        gradients); ``None``: not gated after all (the step is applied).
    """


@hookspec
def on_member_state(covers: set[int]) -> dict[str, Any] | None:
    """What a member that joins (a returning replica group) must receive of this plugin's state from a live one,
    so that its next step is theirs: the sharder's shards, a codec's shared state, a sync mode's global copy and
    outer optimizer. Called on a live member's rank when a member joins (with torchft on its quorum thread, while
    the training thread runs the step's forward). Local; return references (the transport serializes them before
    the step changes them).

    :param covers: the ids of the module's tensors whose values some plugin's state carries; add yours (a sharder
        its parameters' ids): the module's own state, handed over last, then leaves them out.
    :returns: ``{key: state}`` under keys of your own (every plugin's are merged); or ``None``.

    Example::

        @hookimpl
        def on_member_state(self, covers):
            covers.update(id(p) for p in self.params)
            return {"my_plugin": {"shards": [s.detach() for s in self.shards]}}
    """


@hookspec
def on_load_member_state(state: Mapping[str, Any], covers: set[int]) -> None:
    """On a joining member's ranks: load your part of what a live one's ``on_member_state`` returned (the same
    rank of the member: every member has the same layout). Called inside ``on_commit_step`` (or a sync mode's
    commit), before the optimizer steps. Local.

    :param state: the merged dict of every plugin's ``on_member_state`` on the live member; take your key.
    :param covers: as in ``on_member_state``: add the ids of the module's tensors your state carries.
    :returns: nothing.
    """


@hookspec
def on_member_sync_state(covers: set[int]) -> dict[str, Any] | None:
    """With a sync mode: what a member that joins between two syncs must receive of this plugin's state, of what
    every live member holds the same and changes only inside a sync (a sync mode's global copy and outer
    optimizer, a codec's shared state). Called on a live member's rank on a thread of its own, at any time,
    while the training thread runs its inner steps: what it returns is read as it is (a download that overlapped
    a sync is taken again). Local; return references.

    :param covers: the ids of the module's tensors your state gives the joining member values for (a sync mode:
        every synced parameter, which takes the global copy); add yours.
    :returns: ``{key: state}`` under keys of your own (every plugin's are merged); or ``None``.
    """


@hookspec
def on_load_member_sync_state(state: Mapping[str, Any], covers: set[int]) -> None:
    """On a member joining between syncs, before its first step, on every rank: load your part of what a live
    member's ``on_member_sync_state`` returned (the same rank of the member; every rank of the joining member
    loads one sync's state). Local (a sync mode then spreads its replica inside the member: collective there).

    :param state: the merged dict of every plugin's ``on_member_sync_state`` on the live member; take your key.
    :param covers: as in ``on_member_sync_state``.
    :returns: nothing.
    """


@hookspec
def on_member_unify(covers: set[int]) -> None:
    """On every rank of a member, at its first committed step or sync: make what several of its ranks hold the
    same (a node's shards on every node of a member, the module's replicated tensors) one value, taken from the
    member's first such rank. (A member's ranks may each have been healed from a different live member.)
    Collective over the member's ranks, on the thread that commits.

    :param covers: as in ``on_member_state``: add the ids of the module's tensors you make one.
    :returns: nothing.
    """


# -------------------------------------------------------------------------
# Metrics
# -------------------------------------------------------------------------


@hookspec
def on_collect_metrics() -> dict[str, float] | None:
    """Metrics about the optimizer step that just ended.

    Called on the training thread after every optimizer step. Local. The strategy logs the merged dict
    through the Trainer's loggers (every ``log_every_n_steps``) and prints the per-step means at the end of
    ``fit`` on rank 0. Implemented by ``TrafficAccounting`` (``comm/...``) and the ZeRO sharder (``zero/...``).

    :returns: ``{name: value}`` with a ``prefix/name`` (e.g. ``comm/cross_node_MB``), this rank's own values;
        or ``None``.
    """


@hookspec
def on_collect_memory() -> dict[str, int] | None:
    """Bytes of state this plugin keeps on this rank beyond parameters, gradients and optimizer state (which the
    strategy measures itself), by category, for ``HierarchicalZeroStrategy.memory_bytes()`` and the
    ``memory/...`` metrics. Local. Implemented by the sync modes (``outer_state``).

    :returns: ``{category: bytes}``; or ``None``.
    """


# -------------------------------------------------------------------------
# Checkpoints
# -------------------------------------------------------------------------


@hookspec
def on_save_state_dict() -> dict[str, Any] | None:
    """The state this plugin needs to continue after a resume that is the same on every rank (a codec's
    iteration count, PowerSGD's shared Q matrices).

    Called on every rank when a checkpoint is saved, also after ``fit``; global rank 0's answer is written.
    Local; state held in parts on several ranks may be returned as :class:`~ddp_plugin.hookspecs.DeferredTensor`\\ s,
    whose producers gather it while rank 0 writes (every rank taking part returns the same structure). Plugin
    state is declared, never scraped: whatever is not returned here or by ``on_save_rank_state_dict`` is lost on
    resume. Implemented by the codecs and the sync modes.

    :returns: ``{key: state}``, keys unique across plugins (use the plugin's name; the strategy stores the
        merged dict under ``checkpoint["ddp_plugin"]`` and refuses duplicate keys); or ``None``.
    """


@hookspec
def on_save_rank_state_dict() -> dict[str, Any] | None:
    """The state that differs from rank to rank (a codec's error-feedback residuals), which the strategy
    collects from every rank into the checkpoint (one object gather to rank 0).

    Called on every rank when a checkpoint is saved. Local (the strategy runs the collective). A plugin must
    answer on every rank or on none. Implemented by the codecs with error feedback.

    :returns: ``{key: state}`` for this rank, keys unique across plugins; or ``None``.
    """


@hookspec(firstresult=True)
def on_module_state_dict(module: Module) -> dict[str, Any] | None:
    """The module's full state dict for a consolidated checkpoint.

    Called on every rank; only global rank 0's answer is written. Collective. Stops at first non-None result.
    Implemented by the ZeRO sharder (stage 3 gathers one unit at a time).

    :param module: the user's LightningModule.
    :returns: the state dict on rank 0 (anything, e.g. ``{}``, elsewhere); or ``None`` for
        ``module.state_dict()``.
    """


@hookspec(firstresult=True)
def on_optimizer_state_dict(optimizer: Optimizer) -> dict[str, Any] | None:
    """``optimizer``'s state for a consolidated checkpoint, in the layout the unsharded optimizer would have (so
    any world size, stage or plain Lightning can resume from it).

    Called on every rank; only global rank 0's answer is written. Collective. Stops at first non-None result.
    Tensors that must be gathered may be returned as :class:`~ddp_plugin.hookspecs.DeferredTensor`\\ s,
    produced one storage at a time while rank 0 writes; a rank whose producers take part must return them too
    (the strategy runs them on every rank in the order they were made). Implemented by the ZeRO sharder.

    :param optimizer: the user's optimizer.
    :returns: the state dict; or ``None`` for ``optimizer.state_dict()``.
    """


@hookspec(firstresult=True)
def on_load_optimizer_state_dict(optimizer: Optimizer, state_dict: Mapping[str, Any]) -> bool | None:
    """Load an unsharded-layout optimizer state dict into ``optimizer``. Local. Stops at first non-None result.
    Implemented by the ZeRO sharder (takes this rank's pieces). Raise a clear error for a state that does not
    fit.

    :param optimizer: the user's optimizer, as set up for this fit.
    :param state_dict: the state as an unsharded ``optimizer.state_dict()`` has it.
    :returns: ``True`` when loaded; or ``None`` to let ``optimizer.load_state_dict`` do it.
    """


@hookspec(firstresult=True)
def on_local_module_state_dict(module: Module) -> dict[str, Any] | None:
    """For ``checkpoint="sharded"``: this rank's part of the module state. Called on every rank. Local. Stops at
    first non-None result. Implemented by the ZeRO sharder.

    :param module: the user's LightningModule.
    :returns: flat keys, a tensor every rank holds whole under its name and a piece of a sharded one as
        ``<name>#<start>`` (the 1-D slice of the flattened tensor that starts at element ``start``); or ``None``
        for ``module.state_dict()``.
    """


@hookspec(firstresult=True)
def on_local_optimizer_state_dict(optimizer: Optimizer) -> dict[str, Any] | None:
    """For ``checkpoint="sharded"``: this rank's part of ``optimizer``'s state. Called on every rank. Local.
    Stops at first non-None result. Implemented by the ZeRO sharder.

    :param optimizer: the user's optimizer.
    :returns: ``{"state": {flat key: value}, "param_groups": [...], "shapes": {...}}``, parameters numbered as in
        the unsharded ``optimizer.state_dict()``, keys ``<index>/<state key>`` or ``<index>/<state key>#<start>``
        for a piece, and ``shapes`` giving the full shape of every key cut into pieces, or of its parameter
        (``<index>``), on every rank whether or not it holds a piece; or ``None`` for the unsharded state.
    """


@hookspec
def on_load_state_dict(state: Mapping[str, Any], rank_state: Mapping[str, Any] | None) -> None:
    """Restore plugin state from a checkpoint, after ``on_setup`` (a checkpoint loaded before ``fit`` is handed
    over once the plugins exist). Local. Implemented by the codecs.

    :param state: the merged dict every plugin's ``on_save_state_dict`` returned at save time; take your key.
    :param rank_state: the merged dict this rank's ``on_save_rank_state_dict`` answers returned, when the
        checkpoint was saved by as many ranks as this run has; ``None`` otherwise (then per-rank state, which
        does not map onto another world's ranks, starts afresh).
    :returns: nothing.
    """
