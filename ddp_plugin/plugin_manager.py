"""``ddp_plugin.plugin_manager``, the path 0.1.0 documented (``available_codecs()``): the module is
:mod:`ddp_plugin.strategy.plugin_manager`, re-exported here for code that imports it."""

from ddp_plugin.strategy.plugin_manager import (
    available_codecs,
    build_plugin_manager,
    check_plugins,
    cross_node_codec,
    installed_codecs,
)

__all__ = ["available_codecs", "build_plugin_manager", "check_plugins", "cross_node_codec", "installed_codecs"]
