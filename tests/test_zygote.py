"""The suite's own process starter (tests/zygote.py): what a script sees when forked from the zygote is what it
sees in a fresh interpreter, and what the shim's caller sees is what a real interpreter's caller sees."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ddp_plugin.testing import heap
from ddp_plugin.testing.processes import alive
from tests.support import ROOT, needs_cluster, run_python
from ddp_plugin.testing.simcluster import SimulatedCluster
from tests.zygote import SOCKET_ENV, _fork_plan, _plugin_folders, interpreter, start_in_namespaces

REPORT = """
import json, os, sys, lightning
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "parent": os.getppid(), "pid": os.getpid(),
                  "var": os.environ.get("ZYGOTE_TEST_VAR"), "path0": sys.path[0], "executable": sys.executable}))
sys.exit(int(os.environ.get("ZYGOTE_TEST_EXIT", "0")))
"""

pytestmark = pytest.mark.skipif(os.environ.get("DDP_TEST_ZYGOTE", "1") == "0", reason="DDP_TEST_ZYGOTE=0")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "report.py"
    path.write_text(REPORT)
    return path


def report(script, *args, env=None, cwd=None, check=True) -> tuple[dict, subprocess.CompletedProcess]:
    proc = run_python(script, *args, env=env, cwd=cwd, check=check)
    return json.loads(proc.stdout.splitlines()[-1]), proc


def test_a_script_is_forked_from_the_zygote_with_the_callers_argv_folder_environment_and_exit_code(script, tmp_path):
    seen, proc = report(script, "a", "--b", env={"ZYGOTE_TEST_VAR": "x", "ZYGOTE_TEST_EXIT": "3"}, cwd=tmp_path,
                        check=False)
    assert proc.returncode == 3
    assert seen["argv"] == [str(script), "a", "--b"]
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path)
    assert seen["var"] == "x"
    assert seen["parent"] != os.getpid()  # forked by the zygote, not exec'd by the shim this process started
    assert seen["executable"] == interpreter()  # so a launcher's ranks are forked too


def test_a_run_that_changes_what_an_import_reads_gets_a_fresh_interpreter(script):
    seen, _ = report(script, env={"MKL_NUM_THREADS": "1"})
    assert seen["parent"] == os.getpid() and seen["executable"] == sys.executable
    seen, _ = report(script, env={"PYTHONPATH": str(ROOT)})
    assert seen["parent"] == os.getpid()


def test_torchruns_worker_variables_are_applied_in_a_forked_child(tmp_path):
    # torchrun gives its workers OMP_NUM_THREADS=1 and TORCHELASTIC_* (read at run time): each worker was a fresh
    # interpreter before
    script = tmp_path / "threads.py"
    script.write_text(REPORT.replace('"executable": sys.executable}', '"executable": sys.executable, "threads": '
                                     '__import__("torch").get_num_threads(), "run": os.environ["TORCHELASTIC_RUN_ID"]}'))
    proc = run_python(script, env={"OMP_NUM_THREADS": "3", "TORCHELASTIC_RUN_ID": "r", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["parent"] != os.getpid() and (seen["threads"], seen["run"]) == (3, "r")
    assert _fork_plan({"OMP_NUM_THREADS": "0"}, {}) is None and _fork_plan({"OMP_NUM_THREADS": "x"}, {}) is None


PRELOADED = """
import json, os, subprocess, sys
from ddp_plugin.testing.heap import Heap
heap = Heap.attach()
seen = {"parent": os.getppid(), "live": heap.live if heap else None, "executable": sys.executable}
if len(sys.argv) == 1:  # and a process it starts as a launcher starts its ranks
    seen["rank"] = json.loads(subprocess.run([sys.executable, __file__, "rank"], capture_output=True, text=True,
                                             check=True).stdout)
print(json.dumps(seen))
"""


@pytest.mark.skipif(heap.compiler() is None, reason="the heap tracker is compiled with cc or gcc")
def test_a_run_that_preloads_a_library_is_forked_from_a_zygote_started_with_it(tmp_path, heap_env):
    # The memory tests preload the heap tracker (LD_PRELOAD): each of their runs and its ranks was a fresh
    # interpreter (3 launches of 5 Pythons, about 100 CPU seconds of imports).
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED)
    seen = json.loads(run_python(script, env=heap_env).stdout.splitlines()[-1])
    assert seen["parent"] != os.getpid() and seen["executable"] == interpreter()  # forked, not exec'd
    assert seen["rank"]["parent"] == seen["parent"]  # the same zygote forked the launcher's rank
    assert seen["live"] > 0 and seen["rank"]["live"] > 0  # with the tracker counting in each
    plain = json.loads(run_python(script).stdout.splitlines()[-1])
    assert plain["parent"] not in (os.getpid(), seen["parent"]) and plain["live"] is None  # the worker's zygote


@needs_cluster
def test_a_run_inside_a_simulated_node_is_forked_from_a_zygote_in_that_node(tmp_path):
    # (the cluster's launches were fresh interpreters: torchrun and every rank, 2 nodes x 3 Pythons a launch)
    script = tmp_path / "node.py"
    script.write_text(REPORT.replace('"executable": sys.executable}', '"executable": sys.executable, "net": '
                                     'os.stat("/proc/self/ns/net").st_ino}'))
    with SimulatedCluster(nodes=2, rate=None, prefix="ddpzygote", python=interpreter()) as cluster:
        # A socket left by the zygote of a cluster closed before, whose namespace had the same inode (the kernel
        # reuses them): a new zygote could not bind there, and the shim's connection was refused (in the suite
        # every launch of tests/test_cluster.py after tests/test_adaptive.py's cluster on one worker was fresh).
        # (one may be there already: an earlier cluster's on this worker, in the suite)
        for node in range(cluster.nodes):
            path = f"{os.environ[SOCKET_ENV]}@net{os.stat(f'/run/netns/{cluster.node_namespace(node)}').st_ino}"
            if not os.path.exists(path):
                stale = socket.socket(socket.AF_UNIX)
                stale.bind(path)
                stale.close()
        start_in_namespaces(lambda node, argv, **kwargs: cluster.popen(node, argv, env=cluster.launch_env(node),
                                                                       **kwargs), cluster.nodes)
        for node in range(cluster.nodes):
            proc = cluster.popen(node, [interpreter(), str(script)], env=cluster.launch_env(node),
                                 stdout=subprocess.PIPE, text=True)
            out, _ = proc.communicate(timeout=120)
            seen = json.loads(out.splitlines()[-1])
            assert proc.returncode == 0 and seen["parent"] != os.getpid()  # forked by a zygote, not exec'd by the shim
            assert seen["executable"] == interpreter()  # so torchrun's workers are forked there too
            assert seen["net"] == os.stat(f"/run/netns/{cluster.node_namespace(node)}").st_ino != os.stat(
                "/proc/self/ns/net").st_ino


def plugin_folder(folder, module: str, entry_points: bool = True):
    folder.mkdir()
    (folder / f"{module}.py").write_text("codec = 'found'\n")
    info = folder / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    if entry_points:
        (info / "entry_points.txt").write_text(f"[ddp_plugin]\nfound = {module}:codec\n")
    return folder


def test_a_run_that_only_adds_plugin_distributions_to_the_path_is_forked_and_finds_their_entry_points(tmp_path):
    # (the codec tests put an installed example codec on PYTHONPATH: a fresh interpreter per rank, before)
    folder = plugin_folder(tmp_path / "site", "zygote_test_plugin")
    script = tmp_path / "find.py"
    script.write_text(REPORT.replace('"executable": sys.executable}', '"executable": sys.executable, "path1": sys.path[1], '
                                     '"found": [(p.name, p.load()) for p in __import__("importlib.metadata").metadata'
                                     '.entry_points(group="ddp_plugin")]}'))
    proc = run_python(script, pythonpath=[folder])
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["parent"] != os.getpid() and seen["executable"] == interpreter()  # forked
    assert seen["path1"] == str(folder)  # where a fresh interpreter puts PYTHONPATH's folders
    assert seen["found"] == [["found", "found"]]


def test_only_folders_of_plugin_distributions_that_shadow_nothing_are_added_to_a_forked_childs_path(tmp_path):
    # A folder whose modules no entry point names may be read at import (a package probed for, as Lightning probes
    # mpi4py), and one that shadows what the zygote imported would give the child the zygote's module: a fresh
    # interpreter for both (end to end: test_a_run_that_changes_what_an_import_reads_gets_a_fresh_interpreter).
    base = {"PYTHONPATH": "/x"}
    plugins = plugin_folder(tmp_path / "plugins", "zygote_test_plugin")
    assert _plugin_folders({"PYTHONPATH": f"{plugins}{os.pathsep}/x"}, base) == [str(plugins)]
    assert _plugin_folders({"PYTHONPATH": f"{plugins}"}, base) is None  # it dropped the zygote's own folder
    assert _fork_plan({"PYTHONPATH": f"{plugins}{os.pathsep}/x", "MKL_NUM_THREADS": "1"}, base) is None
    assert _fork_plan({"PYTHONPATH": f"{plugins}{os.pathsep}/x", "OMP_NUM_THREADS": "1"}, base) == {
        "threads": 1, "folders": [str(plugins)]}
    bare = plugin_folder(tmp_path / "bare", "zygote_test_bare", entry_points=False)
    assert _plugin_folders({"PYTHONPATH": f"{bare}{os.pathsep}/x"}, base) is None
    shadow = plugin_folder(tmp_path / "shadow", "pluggy")
    assert _plugin_folders({"PYTHONPATH": f"{shadow}{os.pathsep}/x"}, base) is None


def test_a_child_killed_by_a_signal_is_seen_dead_of_it_by_the_caller(tmp_path):
    path = tmp_path / "die.py"
    path.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([interpreter(), str(path)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL


def test_killing_the_caller_ends_the_forked_child_and_a_signal_to_it_reaches_the_child(tmp_path):
    path = tmp_path / "wait.py"
    path.write_text("import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    for sig in (signal.SIGKILL, signal.SIGTERM):
        shim = subprocess.Popen([interpreter(), str(path)], stdout=subprocess.PIPE, text=True)
        child = int(shim.stdout.readline())
        assert child != shim.pid
        shim.send_signal(sig)
        assert shim.wait(timeout=60) == -sig
        deadline = time.monotonic() + 60
        while alive(child):
            assert time.monotonic() < deadline, f"the child lived on after its caller got signal {sig}"
            time.sleep(0.05)


def test_a_child_ends_as_a_process_does_atexit_handlers_threads_and_uncaught_errors(tmp_path):
    path = tmp_path / "end.py"
    path.write_text(
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done', flush=True))).start()\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise ValueError('broke')\n"
        "sys.exit(sys.argv[1] if sys.argv[1] == 'message' else None)\n"
    )
    for how, code in (("raise", 1), ("message", 1), ("none", 0)):
        proc = subprocess.run([interpreter(), str(path), how], capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, (how, proc.stderr)
        assert proc.stdout.splitlines() == ["thread done", "atexit ran"], how  # threads joined, then atexit
        if how == "raise":
            assert "ValueError: broke" in proc.stderr and "Traceback" in proc.stderr
        if how == "message":
            assert proc.stderr.strip() == "message"


def test_a_childs_own_finalizers_run_at_its_exit_and_not_those_its_zygotes_imports_registered(tmp_path):
    # torch.library's finalizers (one per operator library) deregister kernels at exit, writing to the pages the
    # zygote shares: a forked child skips them, as multiprocessing's do; what the script itself registers runs.
    path = tmp_path / "finalizers.py"
    path.write_text(
        "import os, weakref, torch.library\n"
        "class Thing:\n"
        "    pass\n"
        "thing = Thing()\n"
        "weakref.finalize(thing, print, 'own finalizer ran', flush=True)\n"
        "inherited = [f for f in weakref.finalize._registry if f.atexit]\n"
        "print('inherited at exit', sum(f.peek()[1] is torch.library._del_library for f in inherited), flush=True)\n"
        "print('parent', os.getppid(), flush=True)\n"
    )
    proc = subprocess.run([interpreter(), str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "inherited at exit 0" and lines[-1] == "own finalizer ran", lines
    assert lines[1] != f"parent {os.getpid()}"  # (forked by the zygote)


def test_a_caller_in_a_mount_namespace_of_its_own_is_forked_into_it_and_sees_its_mounts(tmp_path):
    # The filesystem faults mount a tmpfs in a mount namespace of their own (tests/filesystems.py); their workers
    # and ranks were fresh interpreters (5 of them, some 20 CPU seconds a test), the zygote being outside it.
    from tests.filesystems import in_tmpfs, tmpfs_unavailable

    reason = tmpfs_unavailable()
    if reason:
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("the namespace is made with a user namespace of its own here: a fresh interpreter, as before")
    mounted, script = tmp_path / "mounted", tmp_path / "mounts.py"
    mounted.mkdir()
    script.write_text(REPORT.replace('"var":', '"mounts": open("/proc/self/mounts").read(), "ns": os.stat('
                                     '"/proc/self/ns/mnt").st_ino, "listed": os.listdir(sys.argv[1]), "var":'))
    (mounted / "outside").write_text("")  # hidden under the tmpfs inside the namespace
    argv = in_tmpfs(mounted, "size=64k", [interpreter(), script, mounted])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["executable"] == interpreter() and seen["parent"] != os.getpid()  # forked by the zygote
    assert seen["ns"] != os.stat("/proc/self/ns/mnt").st_ino  # in the caller's namespace, not the zygote's
    assert f"tmpfs {mounted} tmpfs" in seen["mounts"] and seen["listed"] == []
    assert seen["cwd"] == str(tmp_path)


def test_the_launch_log_counts_a_forked_childs_start_and_the_cpu_it_used(tmp_path):
    from tests.zygote import LAUNCHES_ENV

    path, log = tmp_path / "busy.py", tmp_path / "launches"
    path.write_text("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass\n")
    run_python(path, env={LAUNCHES_ENV: str(log), "PYTEST_CURRENT_TEST": "tests/x.py::t (call)"})
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert lines[0] == ["tests/x.py::t (call)", "launch", "1"], lines
    assert lines[1][:2] == ["tests/x.py::t (call)", "cpu"] and 0.5 <= float(lines[1][2]) < 30, lines


def test_a_rank_forked_by_the_zygote_outside_its_launchers_session_is_killed_by_its_identity_file(tmp_path):
    # A launcher started in a session of its own starts a "rank" through the shim: the rank is the zygote's child,
    # outside that session, so killing the session leaves it running; its identity file reaches it. A file whose
    # process has ended (or whose id another process took since: another start time) is passed over.
    from ddp_plugin.testing.processes import kill_identified, signal_group_quietly

    folder = tmp_path / "procs"
    rank = ("import sys, time; from ddp_plugin.testing.processes import write_identity_file;"
            f" write_identity_file({str(folder)!r}); time.sleep(600)")
    (tmp_path / "rank.py").write_text(rank)
    launcher = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, {str(tmp_path / 'rank.py')!r}]);"
                " time.sleep(600)")
    (tmp_path / "launcher.py").write_text(launcher)
    (folder).mkdir()
    (folder / "proc-1").write_text("1 0")  # (init's id with another start time: not killed)
    proc = subprocess.Popen([interpreter(), str(tmp_path / "launcher.py")], start_new_session=True, cwd=ROOT)
    try:
        deadline = time.time() + 300
        while len(list(folder.glob("proc-*"))) < 2 or any(p.stat().st_size == 0 for p in folder.glob("proc-*")):
            assert time.time() < deadline and proc.poll() is None, "the rank did not start"
            time.sleep(0.1)
        pid = next(int(p.name[5:]) for p in folder.glob("proc-*") if p.name != "proc-1")
        signal_group_quietly(proc.pid)
        proc.wait()
        time.sleep(1)
        assert alive(pid)  # (the zygote forked it: outside the launcher's session)
        kill_identified(folder)
        deadline = time.time() + 60
        while alive(pid):
            assert time.time() < deadline, "not killed"
            time.sleep(0.1)
        assert alive(1)
    finally:
        signal_group_quietly(proc.pid)
        kill_identified(folder)
