"""Start the suite's Python processes from one that has already imported torch and Lightning.

Importing torch, Lightning and this package costs a process 2.5-5 s of CPU, and a multi-rank test starts one
process per rank: most of the suite's time used to be imports. The zygote imports them once per pytest worker,
then forks a child for each ``python script.py ...`` or ``python -m module ...`` the suite runs. The child takes
the caller's argv, environment, working directory and standard streams, and runs the script as ``__main__``, as
the interpreter would, and ends as a process does (non-daemon threads joined, atexit handlers run, streams
flushed), short of the interpreter's final teardown of every module, which multiprocessing's forked children
skip too.

The caller is a real process: the shim (:data:`SHIM_MAIN`), a small Python started without ``site`` (milliseconds), which hands
its argv, environment, folder and streams to the zygote, forwards the signals it gets to the child and exits with
the child's status (or dies of its signal). It is also ``sys.executable`` inside the child, so the processes that
Lightning's launcher starts for the other ranks (it re-executes ``sys.executable`` with the command line) are
forked from the zygote too. Every rank still is its own process, with its own process id, memory and sockets;
the collectives are the real ones. What does not look like a script or module run (``-c``, an interpreter flag
other than torchrun's ``-u``), a run whose environment changes what an import reads (``PYTHONPATH``, unless it
only puts folders of plugin distributions in front: :func:`_plugin_folders`; thread counts, torch's settings), a
caller in another network, user or other namespace (the simulated cluster's nodes), or a zygote that is not
there: the shim ``exec``s the real interpreter instead, as before. A caller in a mount namespace of its own (a
filesystem fault's tmpfs, tests/filesystems.py), the other namespaces the zygote's, gets a child that joins it.

``DDP_TEST_ZYGOTE=0`` turns it off for a whole run (``DDP_TEST_ZYGOTE=0 pytest``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOCKET_ENV = "DDP_TEST_ZYGOTE_SOCKET"
LAUNCHES_ENV = "DDP_PLUGIN_TEST_LAUNCHES"
"""A path: where a caller's environment names one, the zygote appends a line per Python started through the shim
(the test running, as pytest's ``PYTEST_CURRENT_TEST`` names it, ``launch``, and 1 if forked, 0 if a fresh
interpreter) and one per forked child it reaps (the test, ``cpu``, and the child's user and system CPU seconds),
for the suite's time table (tests/conftest.py)."""

IMPORT_TIME_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "TORCH", "PYTORCH", "CUDA", "NCCL")
"""Variables an import may read (prefixes): a run that sets or changes one of them from the zygote's value gets a
fresh interpreter, since the zygote has imported everything already. ``PYTHONUNBUFFERED`` is applied in the
child, ``DDP_TEST_ZYGOTE_SOCKET`` is the zygote's own."""

PRELOAD = (
    "numpy", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
    "torch.distributed.checkpoint", "torch.distributed.elastic.multiprocessing.errors", "lightning",
    "lightning.pytorch", "lightning.fabric", "lightning.pytorch.cli", "ddp_plugin", "ddp_plugin.testing.callbacks",
    "ddp_plugin.testing.data", "ddp_plugin.testing.models", "ddp_plugin.testing.gpt", "ddp_plugin.testing.ranks",
    "ddp_plugin.testing.processes", "ddp_plugin.parallel.tensor_parallel", "ddp_plugin.sync", "torch.distributed.run",
    "torch.distributed.pipelining",
)
OPTIONAL_PRELOAD = ("torchft", "torchft.checkpointing")
"""Imported where installed (an extra): each fault worker imported torchft itself, 0.13 s of CPU a child."""

_HEADER = struct.Struct("!Q")


# ---------------------------------------------------------------- what the shim and the zygote share
def namespaces():
    """The Linux namespaces this process is in (a caller in another network or mount namespace, as the simulated
    cluster's nodes are, gets a fresh interpreter: a forked child would be in the zygote's)."""
    found = {}
    for name in ("net", "mnt", "pid", "user", "ipc", "uts"):
        try:
            found[name] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            found[name] = None
    return found


def preload_suffix(value):
    """What a zygote started with ``LD_PRELOAD=value`` adds to its worker's socket path (:func:`start_preloaded`)."""
    import zlib

    return "@preload-%08x" % zlib.crc32(value.encode())


def receive(conn, n):
    """Exactly ``n`` bytes from ``conn``, or ``None`` when it closes first."""
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            return None
        data += part
    return data


# ---------------------------------------------------------------- the shim: a caller that is a real process
# (Runs without `site`, so it imports nothing of the project: the two functions above are copied into it.)
SHIM_MAIN = '''
REAL = {real!r}
ARGS = sys.argv[1:]


def exec_real():
    os.execv(REAL, [REAL, *sys.argv[1:]])


def forkable(args):
    if args[:1] == ["-u"]:  # torchrun starts its workers with -u; the zygote runs unbuffered anyway
        del args[0]
    if args[:1] == ["-m"]:
        return len(args) > 1
    return bool(args) and args[0].endswith(".py") and not args[0].startswith("-")


path = os.environ.get({socket_env!r})
if not path or not forkable(ARGS):
    exec_real()
if os.path.exists(path + "@net" + str(namespaces()["net"])):  # a zygote inside this network namespace
    path += "@net" + str(namespaces()["net"])
elif os.environ.get("LD_PRELOAD") and os.path.exists(path + preload_suffix(os.environ["LD_PRELOAD"])):
    path += preload_suffix(os.environ["LD_PRELOAD"])  # a zygote started with this library preloaded
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
except OSError:
    exec_real()
request = json.dumps({{"argv": ARGS, "env": dict(os.environ), "cwd": os.getcwd(),
                      "executable": os.path.abspath(sys.argv[0]), "namespaces": namespaces()}}).encode()
try:  # (its mount namespace: a caller in one of its own, with the zygote's other namespaces, is forked into it)
    fds = [0, 1, 2, os.open("/proc/self/ns/mnt", os.O_RDONLY)]
except OSError:
    fds = [0, 1, 2]
socket.send_fds(conn, [struct.pack("!Q", len(request))], fds)
conn.sendall(request)
answer = receive(conn, 8)
child = struct.unpack("!q", answer)[0] if answer else 0
if child <= 0:  # the zygote would not fork this one (its environment differs in what an import reads)
    conn.close()
    exec_real()
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
    signal.signal(sig, lambda number, frame: os.kill(child, number))
status = receive(conn, 8)
status = struct.unpack("!q", status)[0] if status else -signal.SIGKILL
if status < 0:  # die of the child's signal
    if -status not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
os._exit(status)
'''


def write_shim(folder: Path) -> Path:
    import inspect

    shim = folder / "python"
    shim.write_text(f"#!{sys.executable} -S\nimport os, json, signal, socket, struct, sys\n\n\n"
                    + inspect.getsource(namespaces) + "\n\n" + inspect.getsource(preload_suffix) + "\n\n"
                    + inspect.getsource(receive)
                    + SHIM_MAIN.format(real=sys.executable, socket_env=SOCKET_ENV))
    shim.chmod(0o755)
    return shim


# ---------------------------------------------------------------- the zygote
def _changed(env: dict[str, str], base: dict[str, str]) -> list[str]:
    return sorted(k for k in set(env) | set(base) if k.startswith(IMPORT_TIME_ENV)
                  and k not in ("PYTHONUNBUFFERED", SOCKET_ENV) and env.get(k) != base.get(k))


RUNTIME_ENV = ("TORCHELASTIC_", "TORCH_NCCL_")
"""Prefixes of :data:`IMPORT_TIME_ENV` that only run time reads: torchrun's variables for its workers (read by
``torch.distributed.elastic`` and Lightning's environment detection when asked, ``TORCH_NCCL_*`` when an NCCL
group is made). A change in them needs no fresh interpreter."""


def _fork_plan(env: dict[str, str], base: dict[str, str]) -> dict | None:
    """What a forked child must apply for a caller whose environment differs from the zygote's in what an import
    reads, or ``None`` where only a fresh interpreter would do. Applied in the child: ``OMP_NUM_THREADS`` (a
    positive count, as torchrun sets 1 for its workers) through ``torch.set_num_threads``, the zygote having run no
    parallel region, and ``PYTHONPATH`` folders of plugin distributions (:func:`_plugin_folders`)."""
    changed = [k for k in _changed(env, base) if not k.startswith(RUNTIME_ENV)]
    plan: dict = {"threads": None, "folders": []}
    if "OMP_NUM_THREADS" in changed:
        value = env.get("OMP_NUM_THREADS", "")
        if not value.isdigit() or int(value) < 1:
            return None
        plan["threads"] = int(value)
        changed.remove("OMP_NUM_THREADS")
    if "PYTHONPATH" in changed:
        folders = _plugin_folders(env, base)
        if folders is None:
            return None
        plan["folders"] = folders
        changed.remove("PYTHONPATH")
    return None if changed else plan


def _plugin_folders(env: dict[str, str], base: dict[str, str]) -> list[str] | None:
    """The folders a caller's ``PYTHONPATH`` puts in front of the zygote's, where each holds plugin distributions
    only: a ``*.dist-info`` with entry points and the top-level modules they name, none of which the zygote has
    imported or could import from its own path. The library finds entry points when it is asked (not at import),
    so a child with these folders in front of its ``sys.path`` finds what a fresh interpreter would. ``None``
    otherwise: the caller gets a fresh interpreter."""
    import importlib.util

    old = base.get("PYTHONPATH", "")
    new = env.get("PYTHONPATH", "")
    if old and not new.endswith(os.pathsep + old):
        return None
    folders = [f for f in (new[: -len(old) - 1] if old else new).split(os.pathsep) if f]
    for folder in folders:
        try:
            entries = os.listdir(folder)
        except OSError:
            return None
        named: set[str] = set()
        for entry in entries:
            points = os.path.join(folder, entry, "entry_points.txt")
            if entry.endswith(".dist-info") and os.path.isfile(points):
                with open(points) as text:
                    named |= {line.split("=", 1)[1].strip().split(":")[0].split(".")[0]
                              for line in text if "=" in line}
        modules = {entry.split(".")[0] for entry in entries if not entry.endswith(".dist-info")
                   and entry != "__pycache__"}
        if not named or not modules <= named:
            return None
        for name in modules:
            if name in sys.modules or importlib.util.find_spec(name) is not None:
                return None  # it would shadow, or be shadowed by, what the zygote has
    return folders


def _count(env: dict[str, str], kind: str, value: str) -> None:
    """A line in the launch log the caller's environment names (:data:`LAUNCHES_ENV`), if any."""
    if env.get(LAUNCHES_ENV):
        try:
            with open(env[LAUNCHES_ENV], "a") as log:
                log.write(f"{env.get('PYTEST_CURRENT_TEST', '')}\t{kind}\t{value}\n")
        except OSError:
            pass


def _answer(conn: socket.socket, number: int) -> None:
    try:
        conn.sendall(struct.pack("!q", number))
    except OSError:  # the shim is gone; the child's watcher ends the child
        pass


def serve(path: str, compared: tuple[str, ...] = ("net", "mnt", "pid", "user", "ipc", "uts")) -> None:
    """Import, then fork a child per request until the parent (the pytest worker) is gone; a caller in another of
    the ``compared`` namespaces than the zygote's gets a fresh interpreter."""
    import gc
    import importlib
    gc.disable()  # as the gc module's documentation advises for fork without exec: no holes in shared pages,
    for name in PRELOAD:
        importlib.import_module(name)
    for name in OPTIONAL_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.freeze()  # and no collection in a child writing to them (a child's exit took 1-2 s of copy-on-write without)
    # The finalizers those imports registered (torch.library's, one per operator library) do not run at a child's
    # exit, as in multiprocessing's forked children: each deregisters its library's kernels, writing to pages the
    # zygote shares (measured: 60 ms of CPU a child after a few steps, 4 ms without; the suite forks ~640).
    for finalizer in list(weakref.finalize._registry):  # (no public way to list them)
        finalizer.atexit = False
    zygote = os.getpid()
    parent = os.getppid()
    base_env = dict(os.environ)
    here = namespaces()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:  # (a zygote killed with its cluster leaves its socket: a later namespace may have the same inode)
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, tuple[socket.socket, dict[str, str]]] = {}
    print("ready", flush=True)
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
            if wake_r in ready:
                while True:
                    try:
                        if not os.read(wake_r, 512):
                            break
                    except BlockingIOError:
                        break
            while children:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn, env = children.pop(pid, (None, {}))
                if conn is not None:  # counted before the answer: the shim exits on it, and its caller reads the log
                    _count(env, "cpu", f"{usage.ru_utime + usage.ru_stime:.3f}")
                    _answer(conn, -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
                    conn.close()
            if listener in ready:
                conn, _ = listener.accept()
                try:
                    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 4)
                    request = json.loads(receive(conn, _HEADER.unpack(header)[0]) or b"")
                except (OSError, ValueError, struct.error):
                    conn.close()
                    continue
                plan = _fork_plan(request["env"], base_env)
                theirs = request.get("namespaces") or {}
                # (a caller in a mount namespace of its own, e.g. with a tmpfs mounted for a filesystem fault, gets
                # a child that joins that namespace: see _join_mount_namespace)
                joins = "mnt" in compared and theirs.get("mnt") != here["mnt"] and len(fds) == 4
                fresh = len(fds) not in (3, 4) or plan is None or any(
                    theirs.get(k) != here[k] for k in compared if not (k == "mnt" and joins))
                plan = plan and {**plan, "join_mnt": joins}
                _count(request["env"], "launch", str(int(not fresh)))
                if fresh:
                    for fd in fds:
                        os.close(fd)
                    _answer(conn, 0)  # 0: not forked, the shim execs the real interpreter
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    for other, _ in children.values():
                        other.close()
                    _child(request, fds, conn, plan)  # never returns: exits as a process does
                for fd in fds:
                    os.close(fd)
                children[pid] = (conn, {k: v for k, v in request["env"].items()
                                        if k in (LAUNCHES_ENV, "PYTEST_CURRENT_TEST")})
                _answer(conn, pid)
    finally:
        if os.getpid() == zygote:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                os.unlink(path)
            except OSError:
                pass


def _child(request: dict, fds: list[int], conn: socket.socket, plan: dict) -> None:
    import gc
    import importlib
    import random
    import runpy

    gc.enable()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if plan["join_mnt"]:
        _join_mount_namespace(fds[3])
    for fd in fds[3:]:
        os.close(fd)
    for number, fd in enumerate(fds[:3]):
        os.dup2(fd, number)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # sys.stdin/stdout/stderr (and the logging handlers made at import, which hold them) now read and write the
    # caller's streams: same file descriptors. The zygote runs unbuffered, as every run of the suite does.
    sys.executable = request["executable"]
    random.seed()
    from lightning_utilities.core.rank_zero import rank_zero_only
    from lightning.fabric.utilities.rank_zero import _get_rank
    rank_zero_only.rank = _get_rank() or 0

    def watch() -> None:  # the caller gone (killed): so is this process, as it would be with a real interpreter
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-caller-watch", daemon=True).start()
    args = request["argv"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runner = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        runner = lambda: runpy.run_path(args[0], run_name="__main__")  # noqa: E731
    sys.path[1:1] = plan["folders"]  # where a fresh interpreter puts PYTHONPATH's folders: after the script's own
    importlib.invalidate_caches()
    if plan["threads"] is not None:
        import torch

        torch.set_num_threads(plan["threads"])
    try:
        runner()
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException:  # as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _join_mount_namespace(fd: int) -> None:
    """Move this child (one thread, just forked) into the caller's mount namespace (``setns``, which needs the
    capabilities that made it: the caller shares the zygote's user namespace), so that it sees the mounts the
    caller sees; its folder is set again after (``setns`` moves it to the namespace's root)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x00020000) != 0:  # CLONE_NEWNS
        error = ctypes.get_errno()
        os.write(2, f"tests.zygote: could not join the caller's mount namespace: {os.strerror(error)}\n".encode())
        os._exit(1)


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """End the child as the interpreter ends a process (wait for its non-daemon threads, then run the atexit
    handlers, then flush the streams), without the final teardown of every module: in a process forked from
    the zygote that teardown writes to every page the zygote shares with it and took 0.27 s of the 0.31 s of an
    idle child's life (multiprocessing's forked children skip it too)."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls first at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# ---------------------------------------------------------------- the pytest side
_started: dict[str, object] = {}


def _start_zygote(path: str, env: dict[str, str]) -> bool:
    """Start a zygote serving ``path`` with ``env``, ended when this process exits; whether it started."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", path], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        proc.wait()
        return False

    def stop() -> None:
        proc.kill()
        proc.wait()

    atexit.register(stop)
    return True


def _zygote_env() -> dict[str, str]:
    from ddp_plugin.testing.processes import clean_env
    env = {k: v for k, v in clean_env().items() if k != SOCKET_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def interpreter() -> str:
    """The executable to run a test's Python with: the shim of this worker's zygote (started on first use; its
    socket is then in this process's environment, which the tests' processes inherit), or ``sys.executable`` when
    the zygote is off or did not start."""
    if os.environ.get("DDP_TEST_ZYGOTE", "1") == "0" or _started.get("failed"):
        return sys.executable
    if "shim" not in _started:
        folder = Path(tempfile.mkdtemp(prefix="ddp-zygote-"))
        path = str(folder / "socket")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # (registered first: runs after the stops)
        if not _start_zygote(path, _zygote_env()):
            _started["failed"] = True
            return sys.executable
        _started["shim"] = str(write_shim(folder))
        os.environ[SOCKET_ENV] = path
    return str(_started["shim"])


def start_preloaded(env: dict[str, str]) -> None:
    """Where ``env`` preloads a library (``LD_PRELOAD``: the memory tests' heap tracker), start a zygote of this
    worker with it preloaded (once per library), so that a run with that environment, and the ranks its launcher
    starts, are forked from it: each was a fresh interpreter before, importing torch and Lightning again (3 launches
    of 5 Pythons, about 100 CPU seconds). The library is loaded in the zygote as in a fresh interpreter, before
    anything is imported, so a child's counters count what a fresh interpreter's would, the zygote's imports
    included (the tests read them relative to a point of the run). A zygote that does not start leaves these runs
    to fresh interpreters, as before."""
    preload = env.get("LD_PRELOAD")
    if not preload or interpreter() == sys.executable:
        return
    path = os.environ[SOCKET_ENV] + preload_suffix(preload)
    if path not in _started:
        _started[path] = _start_zygote(path, {**_zygote_env(), **{k: v for k, v in env.items()
                                                                   if k.startswith(IMPORT_TIME_ENV)}})


def start_in_namespaces(popen, count: int) -> None:
    """Start a zygote inside each of ``count`` network namespaces (the simulated cluster's nodes), so that what
    this worker's shim starts there is forked from a zygote there. ``popen(i, argv, **kwargs)`` starts ``argv`` in
    namespace ``i`` (:meth:`SimulatedCluster.popen`, which ends them with the cluster). Each binds this worker's
    socket path with ``@net<inode of its namespace>`` added, where the shim looks first; ``ip netns exec`` gives
    each process it starts a mount namespace of its own (the node's ``/sys``), so these compare all namespaces but
    the mount one. A zygote that does not start leaves its node's launches to fresh interpreters, as before."""
    if interpreter() == sys.executable:
        return
    for node in range(count):
        proc = popen(node, [sys.executable, "-m", "tests.zygote", os.environ[SOCKET_ENV], "--in-namespace"],
                     cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        if proc.stdout.readline().strip() != b"ready":
            proc.kill()


if __name__ == "__main__":
    if sys.argv[2:] == ["--in-namespace"]:
        serve(f"{sys.argv[1]}@net{namespaces()['net']}", compared=("net", "pid", "user", "ipc", "uts"))
    else:
        serve(sys.argv[1])
