"""The cell side of the sandbox fork server: what a forked child does before and while it runs code.

`_forkserver.py` imports this sibling file (it is never part of the trainer's imports) and
calls `enter_child` in each forked child: a new session and process group, its own uid,
working directory and private /tmp, the resource limits, stdin from /dev/null, a minimal
environment and a parent-death signal. Then the child runs one cell (`exec_cell`) or, for a
stateful session, reads cells from fd 3 and reports each one's exit status on fd 4
(`session_main`).
"""

import builtins
import ctypes
import json
import os
import resource
import signal
import sys
import traceback

import _sandbox_isolation as isolation  # the sibling file; sys.path[0] is this directory

PR_SET_PDEATHSIG = 1
CELL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
libc = ctypes.CDLL(None, use_errno=True)


def fresh_namespace():
    """The globals a cell starts with: those of a script run as ``__main__``."""
    return {"__name__": "__main__", "__builtins__": builtins}


def _vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _apply_limits(limits, session, own_uid):
    """Resource limits of a child; the address space budget is on top of the warm image.

    RLIMIT_NPROC counts every process of the real uid, so without a uid of its own it
    would count the trainer's threads: it is only set when the child has its own uid.
    """
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    cpu_hard = int(limits.get("session_cpu_s", cpu)) if session else cpu + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, max(cpu, cpu_hard)))
    address_space = _vm_bytes() + int(limits["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    if own_uid:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    fsize = int(limits["max_file_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def enter_child(uid, workdir, keep_in_tmp, limits, out_w, err_w, session_fds):
    """Runs in the forked child: isolate it, then return (the caller runs the code)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for target, fd in zip((3, 4), session_fds):
        os.dup2(fd, target)
    os.closerange(3 + len(session_fds), 1 << 16)
    if keep_in_tmp is not None:
        workdir = isolation.private_tmp(workdir, keep_in_tmp)
    _apply_limits(limits, bool(session_fds), uid is not None)
    os.chdir(workdir)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.environ.clear()
    os.environ.update(CELL_ENV, HOME=workdir, TMPDIR=workdir)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False, encoding="utf-8", errors="replace")
    sys.stderr = open(2, "w", closefd=False, encoding="utf-8", errors="replace")
    sys.argv = ["<cell>"]


def exec_cell(code, namespace):
    """Executes one cell; returns its exit status (0, 1 for an exception, or SystemExit's)."""
    status = 0
    try:
        exec(compile(code, "<cell>", "exec"), namespace)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # the cell's own failure, reported like the interpreter would
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            status = status or 1
    return status


def session_main(code_in=3, result_out=4):
    """Body of a session child: exec cells from fd 3 in one namespace, report on fd 4."""
    namespace = fresh_namespace()
    reader = os.fdopen(code_in, "r", encoding="utf-8")
    for line in reader:
        cell = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)
        budget = int(used.ru_utime + used.ru_stime + cell["cpu_s"] + 1)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (min(budget, hard), hard))
        status = exec_cell(cell["code"], namespace)
        os.write(result_out, (json.dumps({"exit_status": status}) + "\n").encode())
    os._exit(0)
