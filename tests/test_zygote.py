"""The suite's own process starter (tests/zygote.py): what a script sees when forked from the zygote is what it
sees in a fresh interpreter, and what the shim's caller sees is what a real interpreter's caller sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ddp_plugin.testing.processes import alive
from tests.support import ROOT, run_python
from tests.zygote import interpreter

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
    seen, _ = report(script, env={"OMP_NUM_THREADS": "1"})
    assert seen["parent"] == os.getpid() and seen["executable"] == sys.executable
    seen, _ = report(script, env={"PYTHONPATH": str(ROOT)})
    assert seen["parent"] == os.getpid()


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


def test_the_launch_log_counts_a_forked_childs_start_and_the_cpu_it_used(tmp_path):
    from tests.zygote import LAUNCHES_ENV

    path, log = tmp_path / "busy.py", tmp_path / "launches"
    path.write_text("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass\n")
    run_python(path, env={LAUNCHES_ENV: str(log), "PYTEST_CURRENT_TEST": "tests/x.py::t (call)"})
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert lines[0] == ["tests/x.py::t (call)", "launch", "1"], lines
    assert lines[1][:2] == ["tests/x.py::t (call)", "cpu"] and 0.5 <= float(lines[1][2]) < 30, lines
