"""After a failed fit, the rendezvous store's host (global rank 0 under Lightning's launcher) keeps the store up until
the other ranks have read the cause from it."""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from ddp_plugin.health import store as on_store
from ddp_plugin.health.processes import process_gone
from ddp_plugin.health.store import LINGER_S, POLL_S, PREFIX, STORE_TIMEOUT_S, name_ranks

log = logging.getLogger("ddp_plugin.health")


def linger_as_store_host(timeout_s: float = LINGER_S) -> None:
    """After a failed fit, on global rank 0 (the rendezvous store's host under Lightning's launcher): keep the
    store up until every other rank has read the cause from it (its diagnosis is done, it reported its own error,
    or its process on this machine has ended), at most ``timeout_s``. A rank that diagnosed after the host had
    exited would find only the processes that ended, rank 0 first, and could not quote a raising rank's error."""
    if not dist.is_initialized() or dist.get_rank() != 0 or not on_store.rank_0_hosts_store():
        return
    world = dist.get_world_size()

    def accounted(store: dist.Store, rank: int) -> bool:
        return (store.check([f"{PREFIX}/read/{rank}"]) or store.check([f"{PREFIX}/failed/{rank}"])
                or process_gone(on_store.read(store, "process", rank)))

    deadline = time.monotonic() + timeout_s
    try:
        store = on_store.within(STORE_TIMEOUT_S + 1, on_store.connect)
        while time.monotonic() < deadline:
            waiting = on_store.within(STORE_TIMEOUT_S + 1, lambda: [r for r in range(1, world) if not accounted(store, r)])
            if not waiting:
                return
            on_store.sleep(POLL_S)
        log.info("ddp_plugin: rank 0 exits with %s not done reading the failure from the store",
                 name_ranks(waiting))
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
