"""torchft's lighthouse, started without importing torch.

torchft's own ``torchft_lighthouse`` script imports the ``torchft`` package, and with it torch: 1.6 s of CPU on a
quiet core before the lighthouse listens, many times that on a loaded machine, which every group waiting in a sync
then waits too (a lighthouse started again mid-run is on the groups' critical path). The lighthouse itself is Rust,
in torchft's extension module, which needs nothing of torch: this file loads that module alone (about 30 ms) and
runs torchft's ``LighthouseServer`` with ``torchft_lighthouse``'s flags. It is run by path
(:func:`~ddp_plugin.fault_tolerance.launch.lighthouse_command`), never imported as
``ddp_plugin.fault_tolerance.lighthouse`` by the lighthouse's process (that would import the package, and torch,
first), and it imports nothing of ddp_plugin.

    python .../ddp_plugin/fault_tolerance/lighthouse.py --min_replicas 2 --bind [::]:29510   # torchft's flags
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import threading
from pathlib import Path


def extension() -> Path:
    """torchft's compiled module, found without running ``torchft/__init__.py``."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the lighthouse needs torchft: pip install ddp_plugin[torchft]")
    for where in spec.submodule_search_locations:
        for found in sorted(Path(where).glob("_torchft*.so")) + sorted(Path(where).glob("_torchft*.pyd")):
            return found
    sys.exit(f"torchft's compiled module (_torchft) is not in {list(spec.submodule_search_locations)}")


def parser() -> argparse.ArgumentParser:
    """torchft's lighthouse flags, as ``torchft_lighthouse`` spells them."""
    p = argparse.ArgumentParser(prog="lighthouse", description="torchft's lighthouse, without torch")
    p.add_argument("--min_replicas", type=int, required=True, help="the fewest groups a quorum holds")
    p.add_argument("--bind", default="[::]:29510", help="the address to listen on")
    p.add_argument("--join_timeout_ms", type=int, default=60000, help="how long a quorum waits for groups that beat"
                   " but have not asked")
    p.add_argument("--quorum_tick_ms", type=int, default=100)
    p.add_argument("--heartbeat_timeout_ms", type=int, default=5000, help="a group silent this long is lost")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    found = extension()
    spec = importlib.util.spec_from_file_location("torchft._torchft", found)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    server = module.LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                     join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms,
                                     heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(f"lighthouse listening on {server.address()} (min_replicas {args.min_replicas})", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # (run by path: this package's directory is no place to import from)
    sys.exit(main())
