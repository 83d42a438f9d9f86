"""Worker for the simulated-cluster tests: TCP probes between nodes, and a gloo all-reduce under torchrun.

    python simcluster_probe.py echo-server --host 10.77.0.2 --port 5000       # echoes one message
    python simcluster_probe.py echo-client --host 10.77.0.2 --port 5000 --bytes 65536
    python simcluster_probe.py rtt --host 10.77.0.2 --port 5000                  # one round trip, to echo-server
    python simcluster_probe.py busy --bytes 2000                                 # spin 2 s: the CPU share it got
    python simcluster_probe.py sink --host 10.77.0.2 --port 5001 --bytes 50000000
    python simcluster_probe.py source --host 10.77.0.2 --port 5001 --bytes 50000000
    torchrun ... simcluster_probe.py allreduce --mb 10 --iters 3
    torchrun ... simcluster_probe.py crash-on-node --node 1             # node 1 dies, node 0 waits forever

Servers print ``listening`` once they accept connections; every mode prints one JSON line with its result.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

CHUNK = 1 << 20


def _listen(host: str, port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen(1)
    print("listening", flush=True)
    return server


def _recv_exactly(conn: socket.socket, n: int) -> int:
    buf = bytearray(CHUNK)
    got = 0
    while got < n:
        k = conn.recv_into(buf, min(CHUNK, n - got))
        if k == 0:
            break
        got += k
    return got


def echo_server(args: argparse.Namespace) -> dict:
    with _listen(args.host, args.port) as server:
        conn, peer = server.accept()
        with conn:
            size = int.from_bytes(conn.recv(8) or b"\0", "big")
            data = bytearray()
            while len(data) < size:
                chunk = conn.recv(CHUNK)
                if not chunk:
                    break
                data += chunk
            conn.sendall(data)
    return {"peer": peer[0], "bytes": len(data)}


def echo_client(args: argparse.Namespace) -> dict:
    payload = os.urandom(args.bytes)
    with socket.create_connection((args.host, args.port), timeout=10) as conn:
        conn.sendall(len(payload).to_bytes(8, "big") + payload)
        back = bytearray()
        while len(back) < len(payload):
            chunk = conn.recv(CHUNK)
            if not chunk:
                break
            back += chunk
    return {"bytes": len(payload), "echoed": bytes(back) == payload}


def rtt(args: argparse.Namespace) -> dict:
    """The round trip of a 1-byte message over an open connection (to ``echo-server``), in milliseconds."""
    with socket.create_connection((args.host, args.port), timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        conn.sendall((1).to_bytes(8, "big") + b"x")
        back = conn.recv(1)
        return {"ms": (time.perf_counter() - start) * 1e3, "echoed": back == b"x"}


def busy(args: argparse.Namespace) -> dict:
    """Spin for ``--bytes`` milliseconds of wall time; the CPU time this process got in that time, as a share."""
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < args.bytes / 1e3:
        pass
    return {"cpu_share": (time.process_time() - cpu) / (time.perf_counter() - start)}


def sink(args: argparse.Namespace) -> dict:
    with _listen(args.host, args.port) as server:
        conn, _ = server.accept()
        with conn:
            got = _recv_exactly(conn, args.bytes)
            conn.sendall(b"k")  # the source stops its clock here: all bytes have arrived, not just been queued
    return {"bytes": got}


def source(args: argparse.Namespace) -> dict:
    data = b"\0" * CHUNK
    with socket.create_connection((args.host, args.port), timeout=60) as conn:
        start = time.perf_counter()
        left = args.bytes
        while left > 0:
            left -= conn.send(data[: min(CHUNK, left)])
        ack = conn.recv(1)
        seconds = time.perf_counter() - start
    return {"bytes": args.bytes, "seconds": seconds, "gbit_per_s": args.bytes * 8 / seconds / 1e9, "acked": ack == b"k"}


def allreduce(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from ddp_plugin.testing.simcluster import link_bytes  # imports torch and Lightning: not for the TCP probes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = args.mb * 1_000_000 // 4
    ok = True
    dist.all_reduce(torch.ones(1))  # connect every pair before we count or time
    dist.barrier()
    tx_before = link_bytes()["tx"]
    times = []
    for step in range(args.iters):
        # Small integers keep the fp32 sum exact, so equality is the right check.
        tensor = torch.full((numel,), float(rank + step))
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
        expected = float(sum(range(world)) + world * step)
        ok = ok and bool(torch.all(tensor == expected))
    dist.barrier()
    tx = link_bytes()["tx"] - tx_before
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]), "ok": ok,
            "tensor_bytes": numel * 4, "seconds": times, "node_tx_bytes": tx}


def crash_on_node(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    if int(os.environ["GROUP_RANK"]) == args.crash_node:
        sys.exit(3)
    dist.init_process_group("gloo")  # waits for the dead node's ranks: only the launcher can end this
    return {"ok": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["echo-server", "echo-client", "rtt", "busy", "sink", "source", "allreduce",
                                         "crash-on-node"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--bytes", type=int, default=65536)
    parser.add_argument("--mb", type=int, default=10, help="all-reduce tensor size in MB (10^6 bytes)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--crash-node", type=int, default=1, help="the node whose ranks crash (crash-on-node)")
    args = parser.parse_args()
    result = globals()[args.mode.replace("-", "_")](args)
    # One write of the whole line: the ranks of a node share one pipe, and print() writes the text and the
    # newline separately (unbuffered), so two ranks' lines could interleave into one.
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.exit(0 if result.get("ok", True) and result.get("echoed", True) else 1)


if __name__ == "__main__":
    main()
