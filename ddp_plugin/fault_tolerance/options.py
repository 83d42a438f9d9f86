"""``fault_tolerance=``: the flag, checked at construction time (no torch, no torchft import)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ddp_plugin.runtime.checks import check_int, check_positive_number, invalid

REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
ENVIRONMENT = {"replica_group": REPLICA_GROUP_ENV, "replica_groups": REPLICA_GROUPS_ENV, "lighthouse": LIGHTHOUSE_ENV}
"""The environment variables torchft's own examples read, read here for the keys not given."""
DATA_SPLITS = ("fixed", "quorum")


@dataclass(frozen=True)
class FaultTolerance:
    """Replica groups on torchft (docs/fault_tolerance.md). Every key may come from the environment instead."""

    replica_group: int
    """This group's id, 0 to ``replica_groups`` - 1 (``REPLICA_GROUP_ID``); any id not in use with
    ``data_split="quorum"`` (a group joining a running job)."""
    replica_groups: int
    """How many groups the data is split over, live or not (``NUM_REPLICA_GROUPS``); with ``data_split="quorum"``
    the groups launched together (ids 0 to ``replica_groups`` - 1), who split the first epoch."""
    lighthouse: str
    """The lighthouse's address, ``http://host:port`` (``TORCHFT_LIGHTHOUSE``)."""
    min_replicas: int = 1
    """Groups a step needs to commit; fewer live, the others wait for a quorum."""
    quorum_timeout: float = 60.0
    """Seconds a quorum may take (a returning group's healing included) before the step fails."""
    background_heal: bool = True
    """With a sync mode: a returning group downloads the state every live group holds the same between syncs
    while they go on, and enters their next sync (``False``: it heals inside that sync, the live groups waiting)."""
    heal_rate: float | None = None
    """With ``background_heal``: MB a second a live rank serves a returning group at most (``None``: no limit)."""
    dynamic_steps: bool = False
    """With a sync mode: a sync is due when the first group asks for it; every other group sends its own at the end
    of the step it is in, its pseudo-gradient weighted by the steps it carries (a slow group holds no other)."""
    data_split: str = "fixed"
    """``"fixed"``: the data is split over ``replica_groups`` shares, live or not (a lost group's share is not
    trained on until it returns). ``"quorum"``: at each epoch's start over the groups of this group's last quorum (and
    itself): a group that left stops holding a share, one that joined takes one (docs/fault_tolerance.md)."""


def check_fault_tolerance(value: Any) -> FaultTolerance | None:
    """``None``/``False`` (off), ``True`` (every key from the environment), a mapping (LightningCLI YAML) or a
    :class:`FaultTolerance`; the keys checked, naming the flag and what is allowed."""
    if value is None or value is False:
        return None
    if isinstance(value, FaultTolerance):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    elif value is True:
        value = {}
    elif not isinstance(value, Mapping):
        raise invalid("fault_tolerance", value, "None, True, a FaultTolerance or a mapping with the keys"
                      " replica_group, replica_groups, lighthouse, min_replicas, quorum_timeout, background_heal,"
                      " heal_rate, dynamic_steps, data_split")
    known = {f.name for f in fields(FaultTolerance)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"`fault_tolerance` has unknown key(s) {', '.join(map(repr, unknown))}; allowed keys:"
                         f" {', '.join(sorted(known))}.")
    given = dict(value)
    for key, env in ENVIRONMENT.items():
        if key not in given and env in os.environ:
            given[key] = os.environ[env]
            if key != "lighthouse":
                try:
                    given[key] = int(given[key])
                except ValueError:
                    raise ValueError(f"`fault_tolerance`: {env}={os.environ[env]!r} must be an integer.") from None
    missing = [key for key in ENVIRONMENT if key not in given]
    if missing:
        raise ValueError(
            f"`fault_tolerance` needs {', '.join(missing)}: give them as keys, or set"
            f" {', '.join(ENVIRONMENT[k] for k in missing)} (each replica group's launch sets its own id; the"
            " lighthouse is the address `torchft_lighthouse` listens on)."
        )
    split = given.get("data_split", "fixed")
    if split not in DATA_SPLITS:
        raise invalid("fault_tolerance['data_split']", split, " or ".join(map(repr, DATA_SPLITS)))
    groups = check_int("fault_tolerance['replica_groups']", given["replica_groups"], minimum=1)
    if split == "quorum":
        group = check_int("fault_tolerance['replica_group']", given["replica_group"], minimum=0)
    else:
        group = check_int("fault_tolerance['replica_group']", given["replica_group"], minimum=0, maximum=groups - 1,
                          expected=f"an integer from 0 to {groups - 1} (`replica_groups={groups}`; a group joining"
                          f" with a new id needs `data_split='quorum'`)")
    lighthouse = given["lighthouse"]
    if not isinstance(lighthouse, str) or not lighthouse.startswith(("http://", "https://")) or "," in lighthouse:
        raise invalid("fault_tolerance['lighthouse']", lighthouse, "the lighthouse's address, 'http://host:port'"
                      " (several, a standby among them: give them to ddp-plugin-group --lighthouse, which relays"
                      " to the one in use)")
    minimum = check_int("fault_tolerance['min_replicas']", given.get("min_replicas", 1), minimum=1,
                        maximum=groups, expected=f"an integer from 1 to {groups} (`replica_groups`)")
    timeout = check_positive_number("fault_tolerance['quorum_timeout']", given.get("quorum_timeout", 60.0))
    background = given.get("background_heal", True)
    if not isinstance(background, bool):
        raise invalid("fault_tolerance['background_heal']", background, "True or False")
    rate = given.get("heal_rate")
    if rate is not None:
        rate = float(check_positive_number("fault_tolerance['heal_rate']", rate))
    dynamic = given.get("dynamic_steps", False)
    if not isinstance(dynamic, bool):
        raise invalid("fault_tolerance['dynamic_steps']", dynamic, "True or False")
    return FaultTolerance(group, groups, lighthouse, minimum, float(timeout), background, rate, dynamic, split)


def check_composition(c: Mapping[str, Any]) -> None:
    """What cannot run with replica groups yet, refused at construction, saying why."""
    ft = c["fault_tolerance"]
    if ft is None:
        return
    refused = [
        (c["compression"] == "auto", "`compression='auto'` (the link probe's plan measures one group's links)"),
        (c["compression"] not in (None, "auto") and c["compression"] not in _builtin_codecs(),
         f"`compression={c['compression']!r}`, an installed codec (its state is not known to heal; built-in:"
         f" {', '.join(map(repr, _builtin_codecs()))})"),
        (c["pipeline_parallel_size"] > 1 and c["sync_fragments"] > 1,
         "`pipeline_parallel_size` > 1 with `sync_fragments` > 1 (each stage cuts its own fragments: the first"
         " sync's unify of a tied parameter's copies needs all of them stepped)"),
        (bool(c["plugins"]), "`plugins=` (a plugin's collectives would span one group only)"),
    ]
    if c["zero_stage"] > 0 and c["shard_scope"] != "node":
        raise ValueError(
            f"`shard_scope={c['shard_scope']!r}` cannot go with `fault_tolerance`: global shards would spread one copy"
            f" of the model over every replica group, and a lost group would take its shards with it. Use"
            f" `shard_scope='node'` (shards inside a group, a whole replica in each), or drop `zero_stage`."
        )
    gap = c["sync_every"] // c["sync_fragments"]
    if c["max_staleness"] > 0 and c["max_staleness"] >= gap:
        raise ValueError(
            f"`max_staleness={c['max_staleness']}` must be less than `sync_every // sync_fragments` ({gap}) with"
            f" `fault_tolerance`: each sync must be applied before the next one starts (torchft's Manager holds one"
            f" quorum at a time; its own streaming DiLoCo has the same limit on `fragment_sync_delay`)."
        )
    names = [what for bad, what in refused if bad]
    if names:
        raise NotImplementedError(
            f"`fault_tolerance` runs the synchronous data-parallel route and the sync modes (local SGD, DiLoCo,"
            f" streaming DiLoCo, with or without staleness or warm-up steps), at every ZeRO stage, with tensor"
            f" parallelism and pipeline stages inside a group, on groups of one node or several, with or without a"
            f" built-in codec, for now; not yet with {', '.join(names)}. Drop the flag, or those."
        )
    if ft.dynamic_steps and c["sync_every"] <= 1:
        raise ValueError(
            f"`fault_tolerance['dynamic_steps']=True` needs a sync mode (`sync_every` > 1, got {c['sync_every']}):"
            f" on the synchronous route every step is a sync every group takes part in. Set `sync_every`, or drop"
            f" `dynamic_steps`."
        )


def _builtin_codecs() -> list[str]:
    from ddp_plugin.codecs import BUILTIN_CODECS

    return list(BUILTIN_CODECS)
