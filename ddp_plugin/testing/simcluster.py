"""A simulated multi-node cluster on one Linux machine, for tests and benchmarks.

Each node is a network namespace. Two nodes are joined by one veth pair; more nodes hang off a bridge that
lives in its own namespace, so nothing of the simulation touches the machine's root namespace. A ``tbf``
qdisc on every link end caps the egress rate, so each direction of every node's link runs at ``rate``, as a
full-duplex NIC on a switch port would. The ranks of a node run inside its namespace: traffic between them
stays on the namespace's loopback, traffic between nodes crosses the capped link, and the veth counters
(:meth:`SimulatedCluster.tx_bytes`) are the ground truth for cross-node bytes.

Nodes may differ, as a cluster spread over sites does: ``rate`` per node, a one-way ``delay`` per node's link (a
``netem`` qdisc under the rate cap, on both ends of the link: a packet from node i to node j takes
``delay[i] + delay[j]``, each site's uplink latency; needs a kernel with netem, :func:`delay_available`), and a CPU quota per node (``cpu``: its processes together get
at most that many cores, a cgroup of its own), so that a node's bursts do not slow the others::

    SimulatedCluster(nodes=16, rate=["1gbit"] * 4 + ["100mbit"] * 8 + ["20mbit"] * 4,
                     delay=["5ms"] * 4 + ["20ms"] * 8 + ["80ms"] * 4, cpu=0.125)

Namespace and interface names are the only global state: addresses live inside the namespaces, so two
clusters (two pytest runs, say) never see each other's traffic even though both use the same subnet.
Namespace names carry the owning process id, so stale namespaces left by a killed run are removed at the
next start without touching those of a run that is still alive.

Needs root and iproute2 (``ip netns``, ``tc``); :func:`available` says whether this machine can do it::

    from ddp_plugin.testing.simcluster import SimulatedCluster

    with SimulatedCluster(nodes=2, rate="1gbit") as cluster:
        results = cluster.launch(["train.py", "--max-steps", "10"], nproc_per_node=2)
        print(cluster.tx_bytes(0), results[0].stdout)

A process the cluster started reads its own node's counters with :func:`link_bytes` (its link is named by
``GLOO_SOCKET_IFNAME``, which :meth:`SimulatedCluster.launch` sets), e.g. around a timed window of steps.

(About 550 lines: building, driving and tearing down namespaces, links and per-node launches belong together,
and the teardown must hold even on failure; each part is short.)
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ddp_plugin.testing.processes import RENDEZVOUS_ENV, kill_quietly, signal_group_quietly

__all__ = ["NodeResult", "SimulatedCluster", "available", "link_bytes", "delay_available", "parse_delay", "parse_rate",
           "set_link_rate"]

SUBNET = "10.77.0"  # private /24; it only ever exists inside the cluster's own namespaces
BRIDGE = "simbr"
MIN_MASTER_PORT = 29400

# Environment a launched torchrun must not inherit: it would override the rendezvous we set up.
_LAUNCH_ENV_DROP = (
    *RENDEZVOUS_ENV, "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
)

_RATE_UNITS = {  # tc's units: SI multipliers, "bit" for bits and "bps" for bytes per second
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,
}

_sequence = itertools.count()
_live: set[SimulatedCluster] = set()
_live_lock = threading.Lock()


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate such as ``"1gbit"``, ``"200mbit"`` or ``"125mbps"`` (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", rate)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _RATE_UNITS:
        raise ValueError(
            f"rate={rate!r} is not a link rate. Write a number and one of {', '.join(_RATE_UNITS)} (tc's units:"
            " 'bit' is bits per second, 'bps' bytes per second), e.g. rate='1gbit', or rate=None for no cap."
        )
    bits = int(float(match.group(1)) * _RATE_UNITS[unit])
    if bits < 8000:
        raise ValueError(f"rate={rate!r} is {bits} bit/s; use at least 8kbit so a single packet fits in a second.")
    return bits


def parse_delay(delay: str) -> float:
    """Milliseconds of a tc-style time such as ``"20ms"``, ``"1.5ms"``, ``"500us"`` or ``"0.08s"``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*", delay) if isinstance(delay, str) else None
    if not match:
        raise ValueError(f"delay={delay!r} is not a link delay. Write a number and one of us, ms, s (tc's units),"
                         " e.g. delay='20ms', or delay=None for none.")
    return float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2)]


@functools.lru_cache(maxsize=None)
def delay_available() -> tuple[bool, str]:
    """Whether this kernel can delay a link (the ``netem`` qdisc, ``CONFIG_NET_SCH_NETEM``), and if not, why."""
    namespace = f"ddpsimprobe-{os.getpid()}-delay"
    try:
        _run(["ip", "netns", "add", namespace])
        _run(["ip", "-n", namespace, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms"])
    except (RuntimeError, OSError) as err:
        return False, f"this kernel cannot delay a link (no netem qdisc, CONFIG_NET_SCH_NETEM): {err}"
    finally:
        _run(["ip", "netns", "delete", namespace], check=False)
    return True, ""


def _per_node(name: str, value: Any, nodes: int) -> list[Any]:
    """``value`` for every node: one value for all, or a list or tuple of one per node."""
    if isinstance(value, (list, tuple)):
        if len(value) != nodes:
            raise ValueError(f"{name}= has {len(value)} entries for {nodes} nodes: give one per node, or one value"
                             " for all of them.")
        return list(value)
    return [value] * nodes


def _shape(namespace_args: list[str], dev: str, bits_per_s: int | None, delay_ms: float | None) -> None:
    """Give the link end ``dev`` its rate cap and one-way delay, replacing what it had (neither: none)."""
    _run(["tc", *namespace_args, "qdisc", "del", "dev", dev, "root"], check=False)
    tc = ["tc", *namespace_args, "qdisc", "add", "dev", dev]
    if delay_ms:
        # netem holds each packet for the delay, then hands it to the rate cap below it (kernel's own recipe). Its
        # queue must hold a delay's worth of packets at the rate: 80 ms at 1 Gbit/s is 10 MB, 7000 full frames.
        _run([*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms", "limit", "100000"])
        if bits_per_s is not None:
            _run([*tc, "parent", "1:1", "handle", "10:", *_tbf_args(bits_per_s)])
    elif bits_per_s is not None:
        _run([*tc, "root", *_tbf_args(bits_per_s)])


def _tbf_args(bits_per_s: int) -> list[str]:
    # The bucket must hold a whole GSO super-packet (veth passes up to 64 KiB skbs): a smaller burst makes tbf
    # segment every packet in software, which on 2 cores cost 10-30 % of the rate. 1 ms worth of bytes keeps
    # the burst negligible against any transfer we time (at 1gbit 125 kB; measured 0.96 Gbit/s of TCP payload,
    # the rest is Ethernet/IP/TCP headers, which tbf counts). The latency bounds the queue tbf keeps.
    burst = max(128 * 1024, bits_per_s // 8 // 1000)
    return ["tbf", "rate", f"{bits_per_s}bit", "burst", str(burst), "latency", "50ms"]


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` failed with exit code {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def _namespaces() -> list[str]:
    proc = _run(["ip", "-j", "netns", "list"], check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        return []
    return [entry["name"] for entry in json.loads(proc.stdout)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    proc = _run(["ip", "netns", "pids", namespace], check=False)
    for pid in proc.stdout.split():
        if pid.isdigit():
            kill_quietly(int(pid))


def _delete_namespace(namespace: str) -> None:
    # A namespace whose processes are still running outlives `ip netns delete` (only its name goes) and so do
    # its veth ends; kill them first so the links really disappear.
    _kill_namespace_processes(namespace)
    _run(["ip", "netns", "delete", namespace], check=False)


def _remove_stale(prefix: str) -> None:
    """Delete ``<prefix>-<pid>...`` namespaces whose owning process is gone (a run killed before its teardown)."""
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)(?:x\d+-|$)")
    for namespace in _namespaces():
        match = pattern.match(namespace)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(namespace)


@functools.cache
def available() -> tuple[bool, str]:
    """Whether this machine can run a :class:`SimulatedCluster`, and if not, why (a skip reason for tests).

    Tries the real thing once: a namespace with a veth pair and a tbf qdisc, so a missing kernel module
    (veth, sch_tbf) is found here and not in the middle of a test.
    """
    if sys.platform != "linux":
        return False, f"the simulated cluster needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "the simulated cluster needs root (it creates network namespaces); run the tests as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"the simulated cluster needs iproute2; {' and '.join(missing)} not found on PATH"
    _remove_stale("ddpsimprobe")
    namespace = f"ddpsimprobe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", namespace])
        _run(["ip", "-n", namespace, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", "probe0", "root", *_tbf_args(10**9)])
    except (RuntimeError, OSError) as err:
        return False, f"cannot build a simulated node here: {err}"
    finally:
        _run(["ip", "netns", "delete", namespace], check=False)
    return True, ""


def link_bytes(interface: str | None = None) -> dict[str, int]:
    """``{"tx": bytes sent, "rx": bytes received}`` of this node's link, as the kernel counts them in this process's
    network namespace: for a process a :class:`SimulatedCluster` started, its node's veth (the ground truth for
    cross-node bytes). ``interface`` defaults to ``$GLOO_SOCKET_IFNAME``, which :meth:`SimulatedCluster.launch`
    sets to the node's link. Take the difference of two readings, after a barrier, to count a window of steps.

    Reads ``/sys/class/net/<interface>/statistics`` (``ip netns exec`` mounts the namespace's own /sys); where
    /sys was not remounted for the namespace, asks netlink (``ip -s link``) instead."""
    interface = interface or os.environ["GLOO_SOCKET_IFNAME"]
    stats = Path("/sys/class/net") / interface / "statistics"
    if stats.is_dir():
        return {k: int((stats / f"{k}_bytes").read_text()) for k in ("tx", "rx")}
    s = _ip_link_stats(interface)
    return {"tx": s["tx"]["bytes"], "rx": s["rx"]["bytes"]}


def set_link_rate(interface: str | None = None, rate: str | None = "1gbit") -> None:
    """Cap this node's link at ``rate`` from now on (``None``: uncapped), from a process a
    :class:`SimulatedCluster` started (root, in the node's namespace); ``interface`` defaults to
    ``$GLOO_SOCKET_IFNAME``. On a cluster of two nodes joined by one veth pair this is the node's whole egress, as
    :meth:`SimulatedCluster.set_rate` sets it for every node."""
    interface = interface or os.environ["GLOO_SOCKET_IFNAME"]
    _set_rate([], interface, rate)


def _set_rate(namespace_args: list[str], dev: str, rate: str | None) -> None:
    _shape(namespace_args, dev, parse_rate(rate) if rate is not None else None, None)


def _ip_link_stats(interface: str, namespace_args: list[str] | None = None) -> dict[str, Any]:
    """The ``stats64`` counters of ``interface`` over netlink (``ip [-n NS] -s -j link show dev IF``)."""
    proc = _run(["ip", *(namespace_args or []), "-s", "-j", "link", "show", "dev", interface])
    return json.loads(proc.stdout)[0]["stats64"]


@dataclass
class NodeResult:
    """What one node's launcher (torchrun) did: exit code and output of all its ranks together."""

    node: int
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    killed: bool = False  # stopped by us because another node failed or the launch timed out

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class SimulatedCluster:
    """N nodes on one machine: a network namespace per node, links capped at ``rate`` per direction.

    Args:
        nodes: number of nodes. Two are joined by a single veth pair; more by a bridge in an extra namespace.
        rate: egress cap of each node's link in tc's notation (``"1gbit"``, ``"200mbit"``), or None for an
            uncapped link (veth then runs at memory speed, tens of Gbit/s); or a list of one per node.
        delay: one-way latency of each node's link, each direction (``"20ms"``; a packet between two nodes
            crosses both their links), or None; or a list of one per node.
        cpu: cores each node's processes get together at most (a cgroup CPU quota: ``0.5`` is half a core), or
            None for no cap; or a list of one per node. Needs a CPU cgroup controller (cgroup v1's ``cpu``, or
            v2's delegated to this process).
        prefix: start of the namespace names (``<prefix>-<pid>x<n>-node0`` ...). Stale namespaces with this
            prefix whose owning process has died are removed when a cluster starts.
        python: the interpreter :meth:`launch` runs torchrun with (default: this process's, ``sys.executable``;
            the test suite passes its zygote's shim, which forks the ranks from a zygote inside the namespace).

    Use it as a context manager; teardown kills every process left in the namespaces and deletes them, also
    on exceptions and Ctrl-C, and at interpreter exit for a cluster that was never closed.
    """

    def __init__(self, nodes: int = 2, rate: str | None | list[str | None] = "1gbit", prefix: str = "ddpsim",
                 python: str | None = None, delay: str | None | list[str | None] = None,
                 cpu: float | None | list[float | None] = None) -> None:
        if nodes < 2 or nodes > 200:
            raise ValueError(f"nodes={nodes}: a simulated cluster has between 2 and 200 nodes.")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix):
            raise ValueError(
                f"prefix={prefix!r}: use 1-16 lowercase letters and digits, starting with a letter (it names"
                " network namespaces, and stale ones with the same prefix are deleted)."
            )
        self.nodes = nodes
        self.rates = _per_node("rate", rate, nodes)
        """Each node's link rate (tc's notation, or None: uncapped)."""
        self.rate = rate if not isinstance(rate, (list, tuple)) else None
        self.rate_bits = parse_rate(rate) if isinstance(rate, str) else None
        self._rate_bits = [parse_rate(r) if r is not None else None for r in self.rates]
        self.delays = _per_node("delay", delay, nodes)
        """Each node's one-way link delay (tc's notation, or None)."""
        self._delay_ms = [parse_delay(d) if d is not None else None for d in self.delays]
        self.cpus = _per_node("cpu", cpu, nodes)
        """Each node's CPU quota in cores (or None)."""
        for c in self.cpus:
            if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
                raise ValueError(f"cpu={c!r}: a node's CPU quota is a positive number of cores (0.5: half a core),"
                                 " or None for no cap.")
        self._quotas: list[Any] = []
        self.prefix = prefix
        self.python = python or sys.executable
        self._tag = f"{prefix}-{os.getpid()}x{next(_sequence)}"
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.interfaces = [f"sim{i}" for i in range(nodes)]
        self._bridge_namespace = f"{self._tag}-bridge" if nodes > 2 else None
        self._processes: list[subprocess.Popen] = []
        self._next_port = MIN_MASTER_PORT
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> SimulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def start(self) -> None:
        """Create the namespaces, links and rate caps. Called by ``with``; a failure tears down what was built."""
        if self._started:
            return
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"SimulatedCluster cannot start: {reason}")
        _remove_stale(self.prefix)
        self._started = True
        with _live_lock:
            _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        if any(self._delay_ms) and not delay_available()[0]:
            raise RuntimeError(f"SimulatedCluster(delay={self.delays!r}): {delay_available()[1]}")
        for node in range(self.nodes):
            _run(["ip", "netns", "add", self.node_namespace(node)])
            _run(["ip", "-n", self.node_namespace(node), "link", "set", "lo", "up"])
        if self._bridge_namespace is None:
            ns0, ns1 = self.node_namespace(0), self.node_namespace(1)
            _run(["ip", "link", "add", self.interfaces[0], "netns", ns0, "type", "veth",
                  "peer", "name", self.interfaces[1], "netns", ns1])
        else:
            bridge_ns = self._bridge_namespace
            _run(["ip", "netns", "add", bridge_ns])
            _run(["ip", "-n", bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
            _run(["ip", "-n", bridge_ns, "link", "set", BRIDGE, "up"])
            for node in range(self.nodes):
                port = f"port{node}"
                _run(["ip", "link", "add", self.interfaces[node], "netns", self.node_namespace(node), "type", "veth",
                      "peer", "name", port, "netns", bridge_ns])
                _run(["ip", "-n", bridge_ns, "link", "set", port, "master", BRIDGE])
                _run(["ip", "-n", bridge_ns, "link", "set", port, "up"])
                # The switch port's egress is the node's ingress: capping it keeps a node that receives from
                # several others at line rate, as a real switch would (and the node's delay applies both ways).
                _shape(["-n", bridge_ns], port, self._rate_bits[node], self._delay_ms[node])
        for node in range(self.nodes):
            ns, dev = self.node_namespace(node), self.interfaces[node]
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[node]}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _shape(["-n", ns], dev, self._rate_bits[node], self._delay_ms[node])
        if any(c is not None for c in self.cpus):
            from ddp_plugin.testing.cgroup import CpuQuota

            self._quotas = [CpuQuota.make(f"{self._tag}-node{node}", c) if c is not None else None
                            for node, c in enumerate(self.cpus)]

    def set_rate(self, rate: str | None | list[str | None], node: int | None = None) -> None:
        """Cap every link end at ``rate`` from now on (``None``: uncapped; a list: one per node), or only node
        ``node``'s, while processes run; the links keep their delays."""
        nodes = range(self.nodes) if node is None else [node]
        rates = _per_node("rate", rate, self.nodes) if node is None else {node: rate}
        for n in nodes:
            self._check_node(n)
            self.rates[n] = rates[n]
            self._rate_bits[n] = parse_rate(rates[n]) if rates[n] is not None else None
            _shape(["-n", self.node_namespace(n)], self.interfaces[n], self._rate_bits[n], self._delay_ms[n])
            if self._bridge_namespace is not None:
                _shape(["-n", self._bridge_namespace], f"port{n}", self._rate_bits[n], self._delay_ms[n])
        same = len(set(self.rates)) == 1
        self.rate = self.rates[0] if same else None
        self.rate_bits = self._rate_bits[0] if same else None

    def close(self) -> None:
        """Kill everything still running in the cluster and delete its namespaces (and so its links). Idempotent."""
        if not self._started:
            return
        for proc in self._processes:
            _kill_group(proc)
        for proc in self._processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._processes.clear()
        for namespace in [*map(self.node_namespace, range(self.nodes)), self._bridge_namespace]:
            if namespace is not None:
                _delete_namespace(namespace)
        for quota in self._quotas:
            if quota is not None:
                quota.close()
        self._quotas = []
        self._started = False
        with _live_lock:
            _live.discard(self)

    # -- inspection ------------------------------------------------------------------------------------------

    def node_namespace(self, node: int) -> str:
        """Name of node ``node``'s network namespace (for ``ip netns exec``)."""
        self._check_node(node)
        return f"{self._tag}-node{node}"

    def tx_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent over its link: the veth's kernel counter, the ground truth for cross-node bytes.

        It counts frames as the veth sees them, headers included; with GSO that is one set of headers per segment
        of up to 64 KiB, so a bulk transfer reads about 0.1 % above its payload.
        """
        return self._link_stats(node)["tx"]["bytes"]

    def rx_bytes(self, node: int) -> int:
        """Bytes node ``node`` has received over its link."""
        return self._link_stats(node)["rx"]["bytes"]

    def cpu_quota(self, node: int) -> Any:
        """Node ``node``'s CPU cgroup (:class:`~ddp_plugin.testing.cgroup.CpuQuota`: its ``throttled_s``), or None."""
        self._check_node(node)
        return self._quotas[node] if self._quotas else None

    def _link_stats(self, node: int) -> dict[str, Any]:
        # `ip -n` reads the counters over netlink in the node's namespace; /sys/class/net only shows them from a
        # process whose /sys was mounted in that namespace (which `ip netns exec` does for the processes it runs).
        return _ip_link_stats(self.interfaces[node], ["-n", self.node_namespace(node)])

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise IndexError(f"node {node} does not exist: this cluster has nodes 0..{self.nodes - 1}.")

    # -- running things --------------------------------------------------------------------------------------

    def popen(self, node: int, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace, in its own process group; killed at teardown.

        ``env`` replaces the environment as in :class:`subprocess.Popen`; other keyword arguments pass through.
        """
        if not self._started:
            raise RuntimeError("the cluster is not running; use `with SimulatedCluster(...) as cluster:` first.")
        # `ip netns exec` execs argv, so the Popen's pid is argv's own; the new session lets teardown kill the
        # whole tree (torchrun and its ranks) with one signal.
        quota = self._quotas[node] if self._quotas else None
        if quota is not None:  # (the child joins its node's CPU cgroup before it execs: its children inherit it)
            before = kwargs.pop("preexec_fn", None)

            def join() -> None:
                quota.add(os.getpid())
                if before is not None:
                    before()

            kwargs["preexec_fn"] = join
        proc = subprocess.Popen(["ip", "netns", "exec", self.node_namespace(node), *argv], env=env,
                                start_new_session=True, **kwargs)
        self._processes.append(proc)
        return proc

    def launch_env(self, node: int, env: dict[str, str] | None = None) -> dict[str, str]:
        """The environment :meth:`launch` gives node ``node``: ours minus any rendezvous variables, plus ``env``."""
        full = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV_DROP}
        full.update({"PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": self.interfaces[node]})
        full.update(env or {})
        return full

    def launch(self, argv: list[str], nproc_per_node: int, env: dict[str, str] | None = None,
               timeout: float = 300.0) -> list[NodeResult]:
        """Run ``torchrun --nnodes N --node_rank i --nproc_per_node k ... argv`` on every node at once and wait.

        ``argv`` is what follows torchrun's options: a script and its arguments (``["-m", "pkg"]`` works too).
        Node 0's address is the rendezvous; gloo binds to each node's link (``GLOO_SOCKET_IFNAME``). When a node
        fails, the others are killed instead of waiting for their collectives to time out; after ``timeout``
        seconds everyone is killed. Returns one :class:`NodeResult` per node, in node order; never raises for
        a failing job, so check ``result.ok``.
        """
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={nproc_per_node}: each node runs at least one rank.")
        # Each launch gets a fresh port: the previous store's socket may still be in TIME_WAIT.
        port, self._next_port = self._next_port, self._next_port + 1
        logs: list[tuple[IO[bytes], IO[bytes]]] = []
        procs: list[subprocess.Popen] = []
        try:
            for node in range(self.nodes):
                out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # files: no pipe can fill and block
                logs.append((out, err))
                command = [self.python, "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
                           f"--node_rank={node}", f"--nproc_per_node={nproc_per_node}",
                           f"--master_addr={self.addresses[0]}", f"--master_port={port}", "--max_restarts=0", *argv]
                procs.append(self.popen(node, command, env=self.launch_env(node, env), stdout=out, stderr=err))
            timed_out, killed = _wait_all(procs, timeout)
            results = []
            for node, (proc, (out, err)) in enumerate(zip(procs, logs)):
                out.seek(0)
                err.seek(0)
                results.append(NodeResult(node=node, returncode=proc.returncode,
                                          stdout=out.read().decode(errors="replace"),
                                          stderr=err.read().decode(errors="replace"),
                                          timed_out=timed_out, killed=node in killed))
            return results
        finally:
            for proc in procs:
                _kill_group(proc)
                proc.wait()
                self._processes.remove(proc)
            for out, err in logs:
                out.close()
                err.close()


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[bool, set[int]]:
    """Wait for all of ``procs``; stop the rest at the first failure or at the deadline. Returns what happened."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            return False, set()
        failed = any(code not in (None, 0) for code in codes)
        expired = time.monotonic() >= deadline
        if failed or expired:
            running = {i for i, code in enumerate(codes) if code is None}
            for i in running:
                _kill_group(procs[i], grace=2.0)
            return expired, running
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """SIGTERM the process group of ``proc`` (torchrun forwards it to its ranks), then SIGKILL after ``grace``."""
    if proc.poll() is not None:
        # The leader is gone but its ranks may not be; the group id is still the leader's pid.
        signal_group_quietly(proc.pid, signal.SIGKILL)
        return
    signal_group_quietly(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    signal_group_quietly(proc.pid, signal.SIGKILL)


@atexit.register
def _close_leftovers() -> None:
    with _live_lock:
        clusters = list(_live)
    for cluster in clusters:
        cluster.close()
