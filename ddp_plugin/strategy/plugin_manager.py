"""Assembles the plugins one ``fit`` uses: built-ins chosen by flags, installed ones, and the user's objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from ddp_plugin.codecs import BUILTIN_CODECS, available_codecs, implements, installed_codecs
from ddp_plugin.hookspecs import PROJECT_NAME, hooks
from ddp_plugin.plugins import FlatReducer, HierarchicalReducer, MeanAllReduce, TrafficAccounting

if TYPE_CHECKING:
    from ddp_plugin.plugins.cross_stage import CrossStage
    from ddp_plugin.sync.transport import SyncTransport

__all__ = ["available_codecs", "build_plugin_manager", "check_plugins", "cross_node_codec", "installed_codecs",
           "transport"]


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hooks)
    return pm


def build_plugin_manager(
    compression: str | None,
    extra_plugins: Iterable[object],
    hierarchical: bool = False,
    compression_options: Mapping[str, Any] | None = None,
    zero_stage: int = 0,
    shard_scope: str = "global",
    auto_wrap_policy: Any = None,
    sync: dict[str, Any] | None = None,
    prefetch_units: int = 2,
    optimizer_in_backward: bool = False,
    offload: object | None = None,
    planner: object | None = None,
    cross_stage: CrossStage | None = None,
    sync_transport: SyncTransport | None = None,
) -> pluggy.PluginManager:
    """Register, in order: the built-in defaults (``trylast``; the hierarchical or the flat reducer), the
    traffic accounting, the ZeRO sharder (``zero_stage`` 1-3), the built-in codec ``compression`` names
    (constructed with ``compression_options`` as keyword arguments), the sync mode (``sync["every"] > 1``; its
    ``tryfirst`` hooks run ahead of the sharder's and the codec's), installed plugins from entry points (a codec
    only when ``compression`` names it), then the user's ``plugins=`` objects, which pluggy calls first.
    ``check_pending()`` makes a misspelled hook fail here. Installed codecs receive ``compression_options``
    through ``on_setup(options=...)``.

    With a ``cross_stage`` (:class:`~ddp_plugin.plugins.cross_stage.CrossStage`) the reducer is the hierarchical
    one taking it, and so does the ZeRO sharder; else a ``planner``
    (:class:`~ddp_plugin.plugins.adaptive.AdaptivePlanner`) is the reducer. ``sync_transport``
    (:class:`~ddp_plugin.sync.transport.SyncTransport`) is how the sync mode's syncs cross the members. Both come
    from a way to keep members that come and go (fault tolerance's), whose steps between members go through its own
    transport. With
    ``compression="auto"`` every candidate codec is registered under its name (a built-in one constructed with
    ``compression_options[name]``), and :class:`~ddp_plugin.plugins.adaptive.AutoCodec` answers
    ``on_cross_node_reduce`` ahead of them with the one the plan names."""
    from ddp_plugin.gradients.planning import NO_CODEC
    from ddp_plugin.plugins.adaptive import AutoCodec, candidate_names, codec_options
    from ddp_plugin.zero import ZeroSharder

    pm = new_plugin_manager()
    builtins: dict[str, object] = {
        "mean_allreduce": MeanAllReduce(),
        "reducer": HierarchicalReducer(cross_stage) if cross_stage is not None else planner if planner is not None
        else HierarchicalReducer() if hierarchical else FlatReducer(),
        "traffic": TrafficAccounting(),
    }
    if zero_stage:
        # Answers `on_bucket_ready` before the reducer: gradients are reduced to this rank's shard only.
        builtins["zero_sharder"] = ZeroSharder(zero_stage, shard_scope, auto_wrap_policy, prefetch_units,
                                                cross_stage, optimizer_in_backward, offload)
    wanted = candidate_names(compression, dict(compression_options or {}))
    for name in wanted:
        if name in BUILTIN_CODECS:
            builtins[name] = BUILTIN_CODECS[name](**codec_options(name, compression, dict(compression_options or {})))
    if sync is not None and sync["every"] > 1:
        from ddp_plugin.sync import OuterSync

        builtins["outer_sync"] = OuterSync(**sync, transport=sync_transport)
    for name, plugin in builtins.items():
        pm.register(plugin, name=name)
    _load_installed(pm, set(wanted), keep=set(builtins))
    for name in wanted:
        if name != NO_CODEC and pm.get_plugin(name) is None:
            from ddp_plugin.codecs import check_compression

            check_compression(name, {})  # raises, naming the available codecs
    if compression == "auto":
        if planner is None:
            raise ValueError("`compression='auto'` needs the link probe's plan (the strategy makes one).")
        candidates = {name: pm.get_plugin("mean_allreduce" if name == NO_CODEC else name) for name in wanted}
        pm.register(AutoCodec(planner, candidates), name="auto")
    for plugin in extra_plugins:
        pm.register(plugin)
    pm.check_pending()
    return pm


def transport(comm: Any, plugins: Iterable[object]) -> Any:
    """The fit's communicator: ``comm``, or what one of ``plugins`` answers in its place (``on_transport``). Asked
    before the fit's plugin manager exists (the link probe that shapes it runs on the transport)."""
    pm = new_plugin_manager()
    for plugin in plugins:
        pm.register(plugin)
    answer = pm.hook.on_transport(comm=comm)
    return comm if answer is None else answer


def _load_installed(pm: pluggy.PluginManager, codecs: set[str], keep: set[str]) -> None:
    """Installed plugins from entry points, except codecs not named in ``codecs``."""
    pm.load_setuptools_entrypoints(PROJECT_NAME)
    for name, plugin in list(pm.list_name_plugin()):
        if name not in keep and implements(plugin, "on_cross_node_reduce") and name not in codecs:
            pm.unregister(plugin=plugin)


def cross_node_codec(pm: pluggy.PluginManager) -> str | None:
    """The name of the plugin that answers ``on_cross_node_reduce`` ahead of the default mean, or ``None``: what
    :class:`~ddp_plugin.hookspecs.Options` tells plugins, so that none of them inspects the registry. A sync mode's
    plugin is no codec: it answers for the gradients between its syncs (nothing crosses), and its own
    pseudo-gradients then take the plain mean or the codec named here."""
    from ddp_plugin.sync import OuterSync

    for impl in reversed(pm.hook.on_cross_node_reduce.get_hookimpls()):  # the order pluggy calls them
        # (the built-in mean itself only: a subclass of it registered by the user is a plugin of the user's)
        if impl.hookwrapper or impl.wrapper or type(impl.plugin) is MeanAllReduce or isinstance(impl.plugin, OuterSync):
            continue
        return pm.get_name(impl.plugin)
    return None


def check_plugins(plugins: Iterable[object], compression: str | None, options: Mapping[str, Any]) -> None:
    """At construction: the user's plugins' hooks are real hooks with real parameters
    (``pluggy.PluginValidationError`` otherwise), and ``compression_options`` without ``compression`` have a
    reader: a plugin of the user's, or an installed one that is not a codec, taking ``options`` in ``on_setup``
    (a forgotten ``compression=`` would otherwise train uncompressed, silently)."""
    pm = new_plugin_manager()
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()
    if compression is not None or not options:
        return
    _load_installed(pm, set(), keep=set())
    readers = [impl.plugin for impl in pm.hook.on_setup.get_hookimpls() if "options" in impl.argnames]
    if readers:
        return
    allowed = ", ".join(map(repr, available_codecs()))
    raise ValueError(
        f"`compression_options={dict(options)!r}` has no effect: `compression` is not set, and no plugin reads the"
        f" options (a plugin of yours receives them in `on_setup(options=...)`). Set `compression` to the codec"
        f" they are for ({allowed}), or drop `compression_options`."
    )
