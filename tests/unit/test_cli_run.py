"""``freescale``'s way out (``cli.run``): it skips Python's teardown of the loaded modules, but
not what a normal exit does before it: threads still running finish, exit handlers run, the
streams are flushed, and the status is the command's."""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers.launch import REPO

COMMAND = """
import atexit, sys, threading, time
from freescale import cli

def main(argv=None):
    def late():
        time.sleep(0.3)
        open({thread!r}, "w").write("done")
    threading.Thread(target=late).start()
    atexit.register(lambda: open({handler!r}, "w").write("ran"))
    print("the command's last line", end="")  # (block-buffered: a pipe)
    {ending}

cli.main = main
cli.run()
"""


def _run(tmp_path, ending):
    thread, handler = tmp_path / "thread", tmp_path / "handler"
    code = textwrap.dedent(COMMAND).format(thread=str(thread), handler=str(handler), ending=ending)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (stdout buffered, as on a pipe)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    return proc, thread.exists(), handler.exists()


@pytest.mark.parametrize("ending, status", [("return", 0), ("sys.exit(3)", 3), ("sys.exit(None)", 0)])
def test_the_command_s_status_output_threads_and_exit_handlers_survive_the_short_exit(tmp_path, ending, status):
    proc, thread_done, handler_ran = _run(tmp_path, ending)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "the command's last line"
    assert thread_done and handler_ran


def test_an_exit_with_a_message_says_it_and_exits_1(tmp_path):
    proc, _, _ = _run(tmp_path, "sys.exit('freescale: stopped')")
    assert (proc.returncode, proc.stderr) == (1, "freescale: stopped\n")


def test_an_exception_out_of_the_command_ends_the_process_as_python_does(tmp_path):
    proc, thread_done, handler_ran = _run(tmp_path, "raise RuntimeError('boom')")
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    assert thread_done and handler_ran
