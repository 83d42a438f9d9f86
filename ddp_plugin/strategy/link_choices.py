"""The choices made once, at a fit's setup, from the links: ``compression="auto"`` (a codec per bucket),
``hierarchical=None`` (the route) and ``bucket_size_mb="auto"``. The link probe measures them
(:mod:`ddp_plugin.strategy.link_probe`, :mod:`ddp_plugin.gradients.planning`), and the :class:`~ddp_plugin.plugins.adaptive.AdaptivePlanner` made here follows the
plan during the fit; the session asks :class:`LinkChoices` and knows nothing of how."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ddp_plugin import health
from ddp_plugin.hookspecs import Options, local_tensor
from ddp_plugin.strategy.link_probe import agree, probe, probe_codecs
from ddp_plugin.gradients.planning import BUCKET_BAND, FLAT, HIERARCHICAL, NO_CODEC, CommPlan, CostModel, capacity_of
from ddp_plugin.plugins.adaptive import AdaptivePlanner, candidate_names, own_hooks

if TYPE_CHECKING:
    import torch
    import pluggy
    from torch.nn import Module

    from ddp_plugin.runtime.comm import TracedCommunicator
    from ddp_plugin.strategy.config import StrategyConfig
    from ddp_plugin.hookspecs import Topology


class LinkChoices:
    """What the links decide for one fit with ``config``'s flags, over ``module`` on ``topology``."""

    def __init__(self, config: StrategyConfig, topology: Topology, module: Module, comm: TracedCommunicator,
                 device: torch.device) -> None:
        self.config, self.topology, self.module, self.comm, self.device = config, topology, module, comm, device
        self.candidates = candidate_names(config.compression, dict(config.compression_options))
        """The codecs a plan chooses between (``"none"``: no codec): ``compression="auto"``'s candidates, or the one."""
        self.planner: AdaptivePlanner | None = None
        """Made by :meth:`make_plan`."""
        self.hierarchical = False
        """The route decided (the session sets it): what an installed candidate's options say."""

    def probe(self, routes: tuple[str, ...]) -> tuple[CostModel, float]:
        """Probe the links (collective); the candidates are fresh built-in codecs (installed ones: their plugin)."""
        config = self.config
        # (an installed candidate is set up once more for the probe, without buckets, with its own options)
        setup = {"topology": self.topology, "buckets": (), "hook": None, "module": self.module, "comm": self.comm}
        codecs = probe_codecs(self.candidates, config.compression, dict(config.compression_options), self.comm,
                              setup, self.codec_options)
        with health.diagnosed("the link probe"):
            # Global rank 0's figures for every rank: one decides, all agree.
            return agree(probe(self.topology, self.comm, codecs, routes, self.device,
                               max_bytes=self.gradient_bytes()), self.topology)

    def gradient_bytes(self) -> int:
        """This rank's bytes of trainable parameters (local shards of split ones): the most a bucket can hold."""
        return sum(local_tensor(p).numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)

    def installed_candidates(self) -> list[str]:
        """``compression="auto"``'s candidates that are installed codecs (not built in)."""
        from ddp_plugin.codecs import BUILTIN_CODECS

        if self.config.compression != "auto":
            return []
        return [n for n in self.candidates if n not in BUILTIN_CODECS and n != NO_CODEC]

    def setup_plugins(self, pm: pluggy.PluginManager, setup: dict[str, Any]) -> None:
        """Every plugin's ``on_setup`` (``setup``: its arguments). An installed codec among ``compression="auto"``'s
        candidates gets its own name and options, as if ``compression`` named it (:meth:`codec_options`), the other
        plugins the strategy's: pluggy's own call of a hook without some plugins, then theirs alone."""
        installed = self.installed_candidates()
        if not installed:
            pm.hook.on_setup(**setup)
            return
        pm.subset_hook_caller("on_setup", remove_plugins=[pm.get_plugin(n) for n in installed])(**setup)
        for name in installed:
            own_hooks(pm.get_plugin(name)).on_setup(**{**setup, "options": self.codec_options(name)})

    def codec_options(self, name: str) -> Options:
        """The options an installed candidate ``name`` sees: ``compression=name`` and the options under its name."""
        config = self.config
        options = options_for(config, self.hierarchical,
                              float(config.bucket_size_mb) if config.bucket_size_mb != "auto" else 25.0, name)
        return dataclasses.replace(options, compression=name, compression_options=MappingProxyType(
            dict(dict(config.compression_options).get(name, {}))))

    def make_plan(self, routes: tuple[str, ...]) -> tuple[bool, float]:
        """Probe, decide what is fixed for the fit (the bucket size; the route where a sharder's layout or a sync
        mode fixes it), and make the planner; buckets are planned once the engine has built them."""
        config, module = self.config, self.module
        names = self.candidates
        probed = routes  # (a re-plan probes these again: a sync mode's or a sharder's stages are among them)
        model, seconds = self.probe(routes)
        total = self.gradient_bytes()
        if config.bucket_size_mb == "auto":
            from ddp_plugin.gradients.engine import FIRST_BUCKET_BYTES, pack

            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

            def buckets_for(cap: int) -> list[int]:
                return [sum(local_tensor(p).numel() * p.element_size() for _, p in group)
                        for group in pack(reversed(named), cap, FIRST_BUCKET_BYTES)]

            costs = model.bucket_costs(buckets_for, routes, names)
            bucket_size_mb = capacity_of(costs) / 2**20
            why = ", ".join(f"{cap / 2**20:.4g} MiB {seconds * 1e3:.1f} ms" for cap, seconds in costs.items())
            why = (f"{bucket_size_mb:.4g} MiB (predicted: {why}; 25 MiB unless another is cheaper by more than"
                   f" {BUCKET_BAND:.0%}, then the cheapest)")
        else:
            bucket_size_mb, why = float(config.bucket_size_mb), ""
        if len(routes) > 1 and (config.zero_stage or config.sync_every > 1):
            # The route is the sharder's layout (or the sync mode's) for the whole fit: the one with the least
            # predicted time over buckets of this size.
            cap = int(bucket_size_mb * 2**20)
            sizes = [cap] * (total // cap) + ([total % cap] if total % cap else [])
            routes = (model.best_route(sizes, routes, names),)
        plan = CommPlan(model, routes, names, bucket_size_mb, seconds, bucket_reason=why)
        self.planner = AdaptivePlanner(plan, lambda: self.probe(probed))
        return HIERARCHICAL in routes, bucket_size_mb


def plan_routes(hierarchical: bool | None, topology: Topology) -> tuple[str, ...]:
    """The routes a plan chooses between: the flag's when set, both where the layout allows a choice (several
    nodes of several ranks) and ``hierarchical`` is ``None``, else the flat one."""
    if not (topology.num_nodes > 1 and topology.ranks_per_node > 1) or hierarchical is False:
        return (FLAT,)
    if hierarchical:
        return (HIERARCHICAL,)
    return (FLAT, HIERARCHICAL)


def options_for(config: StrategyConfig, hierarchical: bool, bucket_size_mb: float, cross_node_codec: str | None
                ) -> Options:
    """The :class:`Options` plugins see, from the validated flags and what was decided at setup."""
    return Options(
        zero_stage=config.zero_stage, shard_scope=config.shard_scope, hierarchical=hierarchical,  # type: ignore[arg-type]
        compression=config.compression, compression_options=MappingProxyType(dict(config.compression_options)),
        cross_node_codec=cross_node_codec, bucket_size_mb=bucket_size_mb, broadcast_buffers=config.broadcast_buffers,
        devices_per_node=config.devices_per_node,
    )
