"""The simulated cluster: namespaces joined by a capped link, torchrun across them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support import WORKERS, needs_cluster
from ddp_plugin.testing.simcluster import SimulatedCluster, available, delay_available, parse_rate

PROBE = str(WORKERS / "simcluster_probe.py")

pytestmark = needs_cluster  # the `cluster` fixture (conftest.py): 2 nodes, 1 Gbit/s


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()


def serve(cluster: SimulatedCluster, node: int, mode: str, port: int, nbytes: int) -> subprocess.Popen:
    """Start a probe server on ``node`` and return once it accepts connections."""
    server = cluster.popen(node, [sys.executable, PROBE, mode, "--host", cluster.addresses[node], "--port", str(port),
                                  "--bytes", str(nbytes)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    return server


def probe(cluster: SimulatedCluster, node: int, mode: str, host: str, port: int, nbytes: int) -> dict:
    client = cluster.popen(node, [sys.executable, PROBE, mode, "--host", host, "--port", str(port),
                                  "--bytes", str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = client.communicate(timeout=60)
    assert client.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def throughput(cluster: SimulatedCluster, nbytes: int, port: int) -> float:
    """Gbit/s of one TCP transfer from node 0 to node 1, timed until the receiver acknowledges the last byte."""
    sink = serve(cluster, 1, "sink", port, nbytes)
    result = probe(cluster, 0, "source", cluster.addresses[1], port, nbytes)
    assert json.loads(sink.communicate(timeout=30)[0].splitlines()[-1])["bytes"] == nbytes
    return result["gbit_per_s"]


def test_nodes_reach_each_other_over_the_link_and_the_counters_see_it(cluster):
    payload = 256 * 1024
    tx0, rx1 = cluster.tx_bytes(0), cluster.rx_bytes(1)
    server = serve(cluster, 1, "echo-server", 5000, 0)
    result = probe(cluster, 0, "echo-client", cluster.addresses[1], 5000, payload)
    served = json.loads(server.communicate(timeout=30)[0].splitlines()[-1])
    assert result["echoed"]
    assert served["peer"] == cluster.addresses[0]  # arrived over the link, not some other route
    assert cluster.tx_bytes(0) - tx0 >= payload
    assert cluster.rx_bytes(1) - rx1 >= payload


def test_link_runs_close_to_its_rate_cap():
    # Best of two for the lower bound: the machine is shared, and a busy CPU only ever makes a transfer slower.
    # Nothing may ever beat the cap, so the upper bound holds for every attempt.
    with SimulatedCluster(nodes=2, rate="1gbit", prefix="ddpsimrate") as c:
        gigabit = [throughput(c, 50_000_000, 5001)]
        if gigabit[0] < 0.7:
            gigabit.append(throughput(c, 50_000_000, 5002))
    assert max(gigabit) > 0.7 and all(g < 1.05 for g in gigabit), gigabit
    with SimulatedCluster(nodes=2, rate="200mbit", prefix="ddpsimrate") as c:
        slow = throughput(c, 10_000_000, 5001)
    assert 0.14 < slow < 0.21, slow


def test_uncapped_link_is_much_faster_than_a_gigabit(cluster):
    with SimulatedCluster(nodes=2, rate=None, prefix="ddpsimfree") as c:
        assert throughput(c, 50_000_000, 5001) > 2.0


def test_launch_runs_gloo_across_nodes_with_ring_traffic_on_the_link(cluster):
    mb, iters, ranks_per_node = 10, 3, 2
    before = [cluster.tx_bytes(node) for node in range(2)]
    results = cluster.launch([PROBE, "allreduce", "--mb", str(mb), "--iters", str(iters)],
                             nproc_per_node=ranks_per_node, timeout=120)
    sent = [cluster.tx_bytes(node) - before[node] for node in range(2)]
    for result in results:
        assert result.ok, f"node {result.node} exited {result.returncode}:\n{result.stdout}\n{result.stderr[-4000:]}"
    reports = [json.loads(line) for r in results for line in r.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["ok"] for r in reports)
    # Gloo's ring (ranks 0-1 on node 0, 2-3 on node 1) crosses the link once in each direction, and every ring
    # edge carries 2(N-1)/N of the tensor per all-reduce: 1.5x the tensor out of each node (measured 1.003x
    # that, start-up included). A different algorithm in a future gloo would show up here.
    world = 2 * ranks_per_node
    expected = iters * 2 * (world - 1) / world * mb * 1_000_000
    for node in range(2):
        assert 0.9 * expected < sent[node] < 1.25 * expected, (node, sent, expected)


def test_a_failing_node_stops_the_others_promptly(cluster):
    # Node 1's ranks crash before joining; node 0 would otherwise wait for them until the rendezvous times out.
    start = time.monotonic()
    results = cluster.launch([PROBE, "crash-on-node", "--crash-node", "1"], nproc_per_node=1, timeout=60)
    assert not results[1].ok and not results[1].killed
    assert results[0].killed and not results[0].timed_out
    # (well inside the launch's 60 s: 37 s was seen on a loaded 2-core machine, so the bound is not tighter)
    assert time.monotonic() - start < 55


def test_teardown_removes_namespaces_also_after_an_exception():
    with SimulatedCluster(nodes=2, prefix="ddpsimteardown") as c:
        assert c.node_namespace(0) in namespaces()
        sleeper = c.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"])
    assert not any(ns.startswith("ddpsimteardown-") for ns in namespaces())
    assert sleeper.poll() is not None
    with pytest.raises(KeyError):
        with SimulatedCluster(nodes=2, prefix="ddpsimteardown"):
            raise KeyError("boom")
    assert not any(ns.startswith("ddpsimteardown-") for ns in namespaces())


def test_three_nodes_share_a_bridge_and_reach_each_other():
    with SimulatedCluster(nodes=3, rate="1gbit", prefix="ddpsimbridge") as c:
        server = serve(c, 2, "echo-server", 5000, 0)
        assert probe(c, 0, "echo-client", c.addresses[2], 5000, 4096)["echoed"]
        server.communicate(timeout=30)
        server = serve(c, 0, "echo-server", 5000, 0)
        assert probe(c, 1, "echo-client", c.addresses[0], 5000, 4096)["echoed"]
        server.communicate(timeout=30)
        assert c.tx_bytes(2) > 4096 and c.tx_bytes(1) > 4096


def test_rates_read_like_tc():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("200mbit") == 200 * 10**6
    assert parse_rate("12.5mbps") == 100 * 10**6
    with pytest.raises(ValueError, match="rate='fast'"):
        parse_rate("fast")


def test_nodes_can_differ_in_rate_and_cpu():
    """Three sites: node 0 at 200 Mbit/s, node 1 at 20 Mbit/s, node 2 uncapped with a quarter of a core. 0 -> 2 runs
    at node 0's rate, 1 -> 2 at node 1's (a node's own rate changed while it runs too); a busy loop on node 2 gets a
    quarter of a core."""
    with SimulatedCluster(nodes=3, rate=["200mbit", "20mbit", None], cpu=[None, None, 0.25], prefix="ddpsimmix") as c:
        assert c.rates == ["200mbit", "20mbit", None] and c.rate is None
        fast = transfer(c, 0, 2, 5004, 5_000_000)
        slow = transfer(c, 1, 2, 5005, 2_000_000)
        # (tbf lets a burst of 128 KiB through at once: a few % above the cap on transfers this short)
        assert 0.1 < fast < 0.21 and 0.01 < slow < 0.0225, (fast, slow)
        share = probe(c, 2, "busy", "", 0, 1500)["cpu_share"]
        assert share < 0.32, share
        assert c.cpu_quota(2).throttled_s > 0 and c.cpu_quota(0) is None
        c.set_rate("100mbit", node=1)
        assert c.rates == ["200mbit", "100mbit", None]
        assert 0.05 < transfer(c, 1, 2, 5006, 4_000_000) < 0.106


def transfer(c: SimulatedCluster, src: int, dst: int, port: int, nbytes: int) -> float:
    """Gbit/s of one TCP transfer from node ``src`` to node ``dst``."""
    sink = serve(c, dst, "sink", port, nbytes)
    result = probe(c, src, "source", c.addresses[dst], port, nbytes)["gbit_per_s"]
    sink.communicate(timeout=30)
    return result


@pytest.mark.skipif(not delay_available()[0] if available()[0] else True,
                    reason="needs root and a kernel with netem (CONFIG_NET_SCH_NETEM) to delay links")
def test_a_round_trip_crosses_both_nodes_delays_twice():
    """Node 0's link delays 10 ms each way, node 1's 30 ms: a round trip between them takes 2 x (10 + 30) ms, and
    a link keeps its delay when its rate changes."""
    with SimulatedCluster(nodes=3, rate=["200mbit", "20mbit", None], delay=["10ms", "30ms", None],
                          prefix="ddpsimdelay") as c:
        server = serve(c, 1, "echo-server", 5003, 0)
        assert 78 < probe(c, 0, "rtt", c.addresses[1], 5003, 1)["ms"] < 120
        server.communicate(timeout=30)
        c.set_rate("100mbit", node=1)
        server = serve(c, 1, "echo-server", 5006, 0)
        assert 78 < probe(c, 0, "rtt", c.addresses[1], 5006, 1)["ms"] < 120
        server.communicate(timeout=30)


def test_per_node_settings_are_checked_when_the_cluster_is_made():
    with pytest.raises(ValueError, match="rate= has 2 entries for 3 nodes"):
        SimulatedCluster(nodes=3, rate=["1gbit", "1gbit"])
    with pytest.raises(ValueError, match="delay='20' is not a link delay"):
        SimulatedCluster(nodes=2, delay="20")
    with pytest.raises(ValueError, match="cpu=0"):
        SimulatedCluster(nodes=2, cpu=[0, 1])
