"""Assembles the plugins one run uses: built-ins chosen by flags, installed ones, and the user's objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pluggy

from ddp_plugin.hookspecs import PROJECT_NAME, hooks
from ddp_plugin.plugins import FlatReducer, HierarchicalReducer, MeanAllReduce, TrafficAccounting
from ddp_plugin.plugins.codecs import BUILTIN_CODECS
from ddp_plugin.plugins.zero_sharder import ZeroSharder


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hooks)
    return pm


def _is_codec(pm: pluggy.PluginManager, plugin: object) -> bool:
    return any(caller.name == "on_cross_node_reduce" for caller in pm.get_hookcallers(plugin) or ())


def installed_codecs() -> list[str]:
    """Names of the codecs installed packages provide: plugins in the entry-point group ``ddp_plugin`` that
    implement ``on_cross_node_reduce``. The entry point's name is the value to pass as ``compression=``."""
    pm = new_plugin_manager()
    pm.load_setuptools_entrypoints(PROJECT_NAME)
    return sorted(name for name, plugin in pm.list_name_plugin() if _is_codec(pm, plugin))


def available_codecs() -> list[str]:
    """Every valid ``compression=`` name: the built-in codecs, then the installed ones (a built-in name wins
    over an installed codec of the same name)."""
    return [*BUILTIN_CODECS, *(name for name in installed_codecs() if name not in BUILTIN_CODECS)]


def build_plugin_manager(
    compression: str | None,
    extra_plugins: Iterable[object],
    hierarchical: bool = False,
    compression_options: Mapping[str, Any] | None = None,
    zero_stage: int = 0,
    shard_scope: str = "global",
    auto_wrap_policy: Any = None,
) -> pluggy.PluginManager:
    """Register, in order: the built-in defaults (``trylast``; the hierarchical or the flat reducer), the
    traffic accounting, the ZeRO sharder (``zero_stage`` 1-3), the built-in codec ``compression`` names (constructed with ``compression_options`` as
    keyword arguments, so a bad option fails here), installed plugins from entry points (a codec only when
    ``compression`` names it), then the user's ``plugins=`` objects, which pluggy calls first.

    Installed codecs receive ``compression_options`` through ``on_setup(options=...)``."""
    pm = new_plugin_manager()
    builtins: dict[str, object] = {
        "mean_allreduce": MeanAllReduce(),
        "reducer": HierarchicalReducer() if hierarchical else FlatReducer(),
        "traffic": TrafficAccounting(),
    }
    if zero_stage:
        # Answers `on_bucket_ready` before the reducer: gradients are reduced to this rank's shard only.
        builtins["zero_sharder"] = ZeroSharder(zero_stage, shard_scope, auto_wrap_policy)
    if compression in BUILTIN_CODECS:
        builtins[compression] = BUILTIN_CODECS[compression](**dict(compression_options or {}))
    for name, plugin in builtins.items():
        pm.register(plugin, name=name)
    pm.load_setuptools_entrypoints(PROJECT_NAME)
    for name, plugin in list(pm.list_name_plugin()):
        if name not in builtins and _is_codec(pm, plugin) and name != compression:
            pm.unregister(plugin=plugin)
    if compression is not None and pm.get_plugin(compression) is None:
        installed = [name for name in installed_codecs() if name not in BUILTIN_CODECS]
        # Installed codecs first: they are the ones a user most likely meant when a name is not built in.
        allowed = ", ".join(map(repr, [None, *installed, *BUILTIN_CODECS]))
        raise ValueError(
            f"`compression={compression!r}` is not an available codec; allowed values: {allowed} (built-in:"
            f" {', '.join(BUILTIN_CODECS)}; installed: {', '.join(installed) or 'none'}). More codecs come from"
            " installed packages that declare an entry point in the group `ddp_plugin`."
        )
    for plugin in extra_plugins:
        pm.register(plugin)
    # A misspelled hook name in any plugin fails here instead of being silently ignored.
    pm.check_pending()
    return pm
