"""Healing off the critical path (with a sync mode): a returning replica group downloads what every live group
holds the same between two syncs from a live peer while the peers go on with their inner steps, and enters
their next sync as an ordinary member.

Between two syncs of a sync mode the global copy, the outer optimizer's state and a codec's shared state change
on no live group (they change only inside a sync, the same on every group). Each rank of a live group serves
them, as they are, over HTTP (:class:`HealServer`, a thread of its own): a version counter, odd while a sync
writes them (:class:`Version`), tells a download that overlapped a sync, which is then taken again. The
returning group's ranks each download the same group rank's state from a live group (spread over the groups by
group rank), agree on the version over their own group, and load it before their first step: the replica takes
the global copy, the inner optimizer starts afresh (its moments are the group's own, as its pseudo-gradients
are), the learning-rate schedulers and the loop's counters take the peer's values at that sync. No live group
waits for any of it: the returning group asks the lighthouse for no quorum until it holds the state, and torchft's
lighthouse forms a quorum as soon as every member of the previous one has asked (a group that only beats is not
waited for).

What is served streams from the tensors themselves (no copy on the peer): a pickled skeleton of the state, its
tensors replaced by their dtype and shape, then each tensor's bytes in order, in chunks of
:data:`CHUNK_BYTES`, at most ``rate`` bytes a second where a rate is given (so that the syncs' own traffic
comes first on a shared link).
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Bytes written to (or read from) the socket at a time."""

VERSION_HEADER = "X-Ddp-Plugin-Version"


class Version:
    """A sequence counter around the writes of a sync: even while nothing writes what is served, odd while a sync
    does (:meth:`writing` / :meth:`written`); a read that saw the same even value before and after is whole."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def writing(self) -> None:
        with self._lock:
            if self.value % 2 == 0:
                self.value += 1

    def written(self) -> None:
        with self._lock:
            if self.value % 2 == 1:
                self.value += 1

    @property
    def stable(self) -> bool:
        return self.value % 2 == 0


class Torn(Exception):
    """A download that overlapped a sync on the peer (or found one under way): to be taken again."""


def _flatten(state: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return _TensorSlot(len(tensors) - 1, state.dtype, tuple(state.shape))
    if isinstance(state, dict):
        return {k: _flatten(v, tensors) for k, v in state.items()}
    if isinstance(state, list):
        return [_flatten(v, tensors) for v in state]
    if isinstance(state, tuple):
        return tuple(_flatten(v, tensors) for v in state)
    return state


class _TensorSlot:
    def __init__(self, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.index, self.dtype, self.shape = index, dtype, shape


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fill(v, tensors) for v in skeleton)
    return skeleton


def _slots(skeleton: Any, out: list[_TensorSlot]) -> list[_TensorSlot]:
    if isinstance(skeleton, _TensorSlot):
        out.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _slots(v, out)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _slots(v, out)
    return out


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes, without a copy where it is a contiguous CPU tensor."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class HealServer:
    """Serves ``state()`` (the merged state a member joining between syncs receives) under ``version``, on
    ``host``, port chosen by the system, from a daemon thread. ``rate``: bytes a second at most, or ``None``."""

    def __init__(self, host: str, state: Callable[[], dict[str, Any]], version: Version,
                 rate: float | None = None) -> None:
        self.state, self.version, self.rate = state, version, rate
        self.served = 0
        """Downloads served whole."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server._serve(self)

            def log_message(self, *args: Any) -> None:  # (quiet: the fit's own log says what happened)
                pass

        self._http = ThreadingHTTPServer((host, 0), Handler)
        self._http.daemon_threads = True
        self.address = f"http://{host}:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.1,), name="ddp_plugin-heal-server",
                                        daemon=True)
        self._thread.start()

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        before = self.version.value
        if request.path.rstrip("/") == "/version":
            body = str(before).encode()
            request.send_response(200)
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
            return
        if before % 2 or request.path.rstrip("/") != "/state":
            request.send_response(409 if before % 2 else 404)
            request.end_headers()
            return
        try:
            tensors: list[torch.Tensor] = []
            skeleton = pickle.dumps(_flatten(self.state(), tensors))
        except Exception as err:  # noqa: BLE001 - a sync started while it was read: the client takes it again
            log.debug("ddp_plugin: the heal server could not read the state (%s)", err)
            request.send_response(409)
            request.end_headers()
            return
        request.send_response(200)
        request.send_header(VERSION_HEADER, str(before))
        request.end_headers()
        out = request.wfile
        started, sent = time.monotonic(), 0
        try:
            out.write(len(skeleton).to_bytes(8, "little"))
            out.write(skeleton)
            for tensor in tensors:
                view = _byte_view(tensor)
                for lo in range(0, len(view), CHUNK_BYTES):
                    chunk = view[lo : lo + CHUNK_BYTES]
                    out.write(chunk)
                    sent += len(chunk)
                    if self.rate:
                        ahead = sent / self.rate - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
            # The version after the last byte: the client compares it with the one before (a trailer).
            after = self.version.value
            out.write(after.to_bytes(8, "little"))
            out.flush()
            self.served += after == before
        except (BrokenPipeError, ConnectionResetError):  # (the client went away: it died, or takes it again)
            pass

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def fetch(address: str, timeout: float) -> tuple[int, dict[str, Any], int]:
    """Download a :class:`HealServer`'s state: ``(version, state, bytes)``; :class:`Torn` if the peer was inside
    a sync before or during it."""
    try:
        response = urllib.request.urlopen(f"{address}/state", timeout=timeout)  # noqa: S310 - our own peer
    except urllib.error.HTTPError as err:
        if err.code == 409:
            raise Torn(f"{address}: a sync is under way") from None
        raise
    with response:
        version = int(response.headers[VERSION_HEADER])
        size = int.from_bytes(_read(response, 8), "little")
        skeleton = pickle.loads(_read(response, size))  # noqa: S301 - our own peer's
        tensors, total = [], 0
        for slot in _slots(skeleton, []):
            tensor = torch.empty(slot.shape, dtype=slot.dtype)
            if tensor.numel():
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                for lo in range(0, len(view), CHUNK_BYTES):
                    _read_into(response, view[lo : lo + CHUNK_BYTES])
            total += tensor.numel() * tensor.element_size()
            tensors.append(tensor)
        after = int.from_bytes(_read(response, 8), "little")
    if after != version:
        raise Torn(f"{address}: a sync ran during the download (version {version} -> {after})")
    return version, _fill(skeleton, tensors), total


def behind(step: int, members: list[tuple[str, str, int]]) -> bool:
    """Whether a heal server's state of torchft step ``step`` is behind the last quorum (``members``, as
    :func:`~ddp_plugin.fault_tolerance.torchft_adapter.previous_quorum` reads them, each with the step it asked
    at): a member that heals inside that quorum asked at a lower step, and serves the sync before it until it has
    healed (seen on the simulated cluster: a returning group took it, and healed again inside its first quorum)."""
    return bool(members) and step < max(m[2] for m in members)


def version_of(address: str, timeout: float) -> int:
    with urllib.request.urlopen(f"{address}/version", timeout=timeout) as response:  # noqa: S310
        return int(response.read())


def _read(stream: io.BufferedIOBase, n: int) -> bytes:
    data = bytearray(n)
    _read_into(stream, memoryview(data))
    return bytes(data)


def _read_into(stream: Any, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise ConnectionError("the peer closed the connection in the middle of its state")
        got += n
