"""geompi.runtime.end_process: a process ends as ``sys.exit`` would end it, less the teardown.

Each case runs a small script in a fresh interpreter and checks what a normal exit guarantees:
the status, atexit handlers (in their order), a thread that is not a daemon finishing, a file
written but never flushed or closed, and text left in C's stdio buffer.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.mpirun import MPI_ENV, REPO

SCRIPT = """
import atexit, ctypes, sys, threading, time
from geompi.runtime import end_process

out = sys.argv[1]
atexit.register(lambda: open(out + "/atexit", "a").write("first registered\\n"))
atexit.register(lambda: open(out + "/atexit", "a").write("last registered\\n"))
held = open(out + "/held", "w")  # noqa: SIM115 - never closed: the end must flush it
held.write("written, never flushed")

def late():
    time.sleep(0.3)
    open(out + "/thread", "w").write("done")

threading.Thread(target=late).start()
# an executor's idle worker is a thread that is not a daemon: it ends when told at exit
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)
pool.submit(sum, [1, 2]).result()
libc = ctypes.CDLL(None)
libc.printf(b"from C's stdio\\n")  # a pipe: fully buffered in C until flushed
print("from Python", flush=False)
end_process({status})
print("not reached")
"""


@pytest.mark.parametrize(
    ("status", "code", "stderr"), [("0", 0, ""), ("None", 0, ""), ("3", 3, ""), ("'bye'", 1, "bye")]
)
def test_end_process_keeps_what_a_normal_exit_does(tmp_path, status, code, stderr):
    script = tmp_path / "end.py"
    script.write_text(textwrap.dedent(SCRIPT.format(status=status)))
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == code, r.stderr
    assert r.stderr.strip() == stderr
    assert "from Python" in r.stdout and "from C's stdio" in r.stdout, r.stdout
    assert "not reached" not in r.stdout
    # atexit's order: the last registered first, as at a normal exit
    assert (tmp_path / "atexit").read_text() == "last registered\nfirst registered\n"
    assert (tmp_path / "held").read_text() == "written, never flushed"
    assert (tmp_path / "thread").read_text() == "done"


def test_a_standard_output_that_cannot_be_written_makes_0_into_120(tmp_path):
    """As Python's own exit: the output could not be written, so the status says so."""
    script = tmp_path / "closed.py"
    script.write_text(
        "import sys\nfrom geompi.runtime import end_process\nprint('x' * 100)\nend_process(0)\n"
    )
    r = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    r.stdout.close()  # the reader is gone: the flush at the end fails
    assert r.wait(timeout=60) == 120


def test_end_process_finalizes_mpi_as_mpi4py_would(tmp_path):
    """In a process that started MPI, MPI ends finalized (mpi4py's own exit hook, which
    end_process skips with the teardown, would have finalized it)."""
    script = tmp_path / "mpi_end.py"
    script.write_text(
        textwrap.dedent(
            """
            import atexit, sys
            from mpi4py import MPI
            from geompi.runtime import end_process

            def check():  # atexit runs before MPI ends: it is still up here
                open(sys.argv[1], "w").write(str(MPI.Is_finalized()))
            atexit.register(check)
            assert MPI.Is_initialized()
            end_process(0)
            """
        )
    )
    flag = tmp_path / "finalized_at_atexit"
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent(
            f"""
            import runpy, sys
            from mpi4py import MPI
            import geompi.runtime as rt

            real = rt._finalize_mpi
            def spy():
                real()
                open({str(tmp_path / "after")!r}, "w").write(str(MPI.Is_finalized()))
            rt._finalize_mpi = spy
            sys.argv = [{str(script)!r}, {str(flag)!r}]
            runpy.run_path({str(script)!r}, run_name="__main__")
            """
        )
    )
    r = subprocess.run(
        [sys.executable, str(probe)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, **MPI_ENV, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    assert flag.read_text() == "False"
    assert (tmp_path / "after").read_text() == "True"
