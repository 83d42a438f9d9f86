"""One process (a world of one over gloo) that diagnoses a failed collective while a SIGTERM arrives, whose
handler fails its own collective, as Lightning's does under torchrun (which SIGTERMs the survivors of a dead
rank): the diagnosis must still be what the process raises, and the handler must still have run.

    python -m tests.workers.sigterm_during_diagnosis      # prints a JSON line
"""

from __future__ import annotations

import json
import os
import signal

import torch.distributed as dist

from ddp_plugin import health
from ddp_plugin.testing.ranks import free_port


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    calls = []

    def failing_handler(signum, frame):  # Lightning's _sigterm_notifier_fn broadcasts, and fails
        calls.append(signum)
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    signal.signal(signal.SIGTERM, failing_handler)
    health.shield_sigterm_handler()  # what the strategy does once the Trainer has installed its handlers
    try:
        # Delivered at once, in this frame or at the entry of diagnose(): outside anything diagnose() can guard.
        os.kill(os.getpid(), signal.SIGTERM)
        message = health.diagnose(RuntimeError("Connection reset by peer"))
        raised = None
    except Exception as err:  # noqa: BLE001 - the outcome the test checks
        message, raised = None, f"{type(err).__name__}: {err}"
    print(json.dumps({"message": message, "raised": raised, "handler_calls": len(calls)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
