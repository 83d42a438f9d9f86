"""``ddp-plugin-group``: start one replica group of a fault-tolerant run (and, where asked, the lighthouse), the same
command on one machine, on the simulated cluster and on a cluster (docs/fault_tolerance.md#launch).

    ddp-plugin-group --group 0 --groups 3 --start-lighthouse train.py --lr 1e-3      # the first group, and the lighthouse
    ddp-plugin-group --group 1 --groups 3 --lighthouse http://host0:29510 train.py --lr 1e-3
    ddp-plugin-group --group 2 --groups 3 --lighthouse http://host0:29510 --nproc-per-node 8 train.py --lr 1e-3
    ddp-plugin-group --group 1 --groups 3 --lighthouse http://host0:29510,http://host1:29510 train.py   # a standby

It sets what the strategy's ``fault_tolerance=True`` reads (``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``,
``TORCHFT_LIGHTHOUSE``) and the group's own rendezvous (``MASTER_ADDR``, ``MASTER_PORT``: by default port
``29600 + group``, so that groups on one machine do not meet), waits until the lighthouse answers, then runs the
script: as it is (Lightning's launcher starts the ranks ``Trainer(devices=...)`` asks for), or under
``torchrun`` with ``--nproc-per-node`` (and ``--nnodes``/``--node-rank`` for a group of several nodes, each node
running the same command with its ``--node-rank`` and the first node's address as ``--master-addr``).
With ``--start-lighthouse`` it starts torchft's lighthouse first and keeps it up after its own group ends, until
no group beats any more. With several ``--lighthouse`` addresses (a standby: another group's launcher started with
``--start-lighthouse`` too) the ranks reach them through a relay on this process
(:class:`~ddp_plugin.fault_tolerance.relay.LighthouseRelay`), which goes on with the next one when the lighthouse in
use stops answering. The group's exit code is the command's; SIGINT and SIGTERM are passed on to it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from ddp_plugin.fault_tolerance.relay import addresses_of, beating_count

LIGHTHOUSE_PORT = 29510
MASTER_PORT = 29600
"""A group's rendezvous port is this plus its id unless ``--master-port`` says otherwise."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddp-plugin-group", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, required=True, help="this group's id, 0 to --groups - 1 (REPLICA_GROUP_ID);"
                   " a new id for a group joining a running job (its script's fault_tolerance data_split='quorum')")
    p.add_argument("--groups", type=int, required=True, help="how many groups the data is split over"
                   " (NUM_REPLICA_GROUPS)")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"), help="the lighthouse's address,"
                   " http://host:port (default: TORCHFT_LIGHTHOUSE; with --start-lighthouse: this machine's), or"
                   " several, comma-separated, the first one the groups use and the others standbys, in order")
    p.add_argument("--start-lighthouse", action="store_true", help="start torchft_lighthouse here first")
    p.add_argument("--lighthouse-port", type=int, default=LIGHTHOUSE_PORT)
    p.add_argument("--min-replicas", type=int, default=1, help="the lighthouse's --min_replicas (give a majority of"
                   " the groups if it may be restarted mid-run)")
    p.add_argument("--join-timeout-ms", type=int, default=10000, help="the lighthouse's --join_timeout_ms")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"), help="the group's"
                   " rendezvous host (its first node's address on a cluster; default MASTER_ADDR or 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, help=f"the group's rendezvous port (default"
                   f" {MASTER_PORT} + --group)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="run the script under torchrun with this many"
                   " ranks a node (default: as it is, Lightning's launcher starting its ranks)")
    p.add_argument("--nnodes", type=int, default=1, help="with --nproc-per-node: the group's nodes")
    p.add_argument("--node-rank", type=int, default=0, help="with --nproc-per-node: this node's rank in the group")
    p.add_argument("--wait-lighthouse", type=float, default=120.0, help="seconds to wait for the lighthouse to answer")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Bad input named with its flag and what is allowed, before anything starts."""
    if args.groups < 1:
        p.error(f"--groups={args.groups}: must be 1 or more")
    if args.group < 0:
        p.error(f"--group={args.group}: must be 0 or more (0 to {args.groups - 1} for the groups launched together)")
    if not 1 <= args.min_replicas <= args.groups:
        p.error(f"--min-replicas={args.min_replicas}: must be from 1 to {args.groups} (--groups)")
    if args.lighthouse is None and not args.start_lighthouse:
        p.error("give --lighthouse http://host:port (or set TORCHFT_LIGHTHOUSE), or --start-lighthouse")
    for address in addresses_of(args.lighthouse or ""):
        if not re.match(r"^https?://[^/:,]+(:\d+)?/?$", address):
            p.error(f"--lighthouse={args.lighthouse!r}: must be the lighthouse's address, http://host:port, or several,"
                    f" comma-separated ({address!r} is not one)")
    if args.lighthouse is not None and not addresses_of(args.lighthouse):
        p.error(f"--lighthouse={args.lighthouse!r}: give the lighthouse's address, http://host:port")
    if args.nproc_per_node is None and (args.nnodes != 1 or args.node_rank != 0):
        p.error("--nnodes and --node-rank need --nproc-per-node (a group of several nodes runs under torchrun)")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        p.error(f"--nproc-per-node={args.nproc_per_node}: must be 1 or more")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank={args.node_rank}: must be from 0 to {args.nnodes - 1} (--nnodes={args.nnodes})")
    if not Path(args.script).is_file():
        p.error(f"script {args.script!r}: no such file")


def lighthouse_command() -> list[str]:
    """The command that starts torchft's lighthouse (its flags go after it): ``lighthouse.py`` of this package, run
    by path, which loads torchft's compiled lighthouse without importing torch (torchft's own
    ``torchft_lighthouse`` imports torch first: 1.6 s of CPU, which a lighthouse started again mid-run costs every
    group waiting in a sync)."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        sys.exit("ddp-plugin-group: --start-lighthouse needs torchft's lighthouse: pip install ddp_plugin[torchft]")
    return [sys.executable, str(Path(__file__).resolve().with_name("lighthouse.py"))]


def reachable(address: str, timeout: float) -> bool:
    url = urlparse(address)
    try:
        socket.create_connection((url.hostname, url.port or 80), timeout=timeout).close()
        return True
    except OSError:
        return False


def command(args: argparse.Namespace, port: int) -> list[str]:
    if args.nproc_per_node is None:
        return [sys.executable, args.script, *args.args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}",
            f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
            f"--master-port={port}", args.script, *args.args]


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check(args, p)
    port = args.master_port if args.master_port is not None else MASTER_PORT + args.group
    lighthouse = relay = None
    if args.start_lighthouse:
        address = args.lighthouse or f"http://{socket.gethostname()}:{args.lighthouse_port}"
        lighthouse = subprocess.Popen([*lighthouse_command(), "--min_replicas", str(args.min_replicas),
                                       "--join_timeout_ms", str(args.join_timeout_ms), "--bind",
                                       f"[::]:{args.lighthouse_port}"], start_new_session=True)
        probe = f"http://127.0.0.1:{args.lighthouse_port}"
    else:
        address = probe = args.lighthouse
    listed = addresses_of(address)
    probes = [probe] if lighthouse is not None or len(listed) == 1 else listed
    deadline = time.monotonic() + args.wait_lighthouse
    while not any(reachable(a, 2.0) for a in probes):
        if lighthouse is not None and lighthouse.poll() is not None:
            sys.exit(f"ddp-plugin-group: the lighthouse exited with {lighthouse.returncode} (is port"
                     f" {args.lighthouse_port} taken?)")
        if time.monotonic() > deadline:
            sys.exit(f"ddp-plugin-group: no lighthouse at {', '.join(probes)} answered within"
                     f" {args.wait_lighthouse:g} s (--wait-lighthouse): is it started, and reachable from here?")
        time.sleep(0.2)
    if len(listed) > 1:  # (a standby: the ranks reach the lighthouse in use through a relay on this process)
        from ddp_plugin.fault_tolerance.relay import LighthouseRelay

        relay = LighthouseRelay(listed)
        print(f"ddp-plugin-group: lighthouses {', '.join(listed)}, through {relay.address} (now"
              f" {listed[relay.current]})", flush=True)
        address = relay.address
    env = {**os.environ, "REPLICA_GROUP_ID": str(args.group), "NUM_REPLICA_GROUPS": str(args.groups),
           "TORCHFT_LIGHTHOUSE": address, "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port)}
    print(f"ddp-plugin-group: group {args.group} of {args.groups}, lighthouse {address}, rendezvous"
          f" {args.master_addr}:{port}", flush=True)
    group = subprocess.Popen(command(args, port), env=env)

    def forward(signum: int, _frame: object) -> None:
        group.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    code = group.wait()
    if relay is not None:
        relay.close()
    if lighthouse is not None:
        # (the other groups may still sync: the lighthouse stays until none beats; torchft's own beat timeout)
        while lighthouse.poll() is None and beating_count(probe, 5.0) > 0:
            time.sleep(1.0)
        lighthouse.terminate()
        try:
            lighthouse.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lighthouse.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
