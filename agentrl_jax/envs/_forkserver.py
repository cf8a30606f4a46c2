"""Fork server of the sandbox pool: a pre-warmed interpreter that forks one child per cell.

The pool (`agentrl_jax/envs/sandbox.py`) starts this file as a script, never imports it,
so the trainer process does not fork. What a child does before and while it runs a cell is
in `_sandbox_child.py`. The server imports numpy/sympy once, isolates itself
(`_sandbox_isolation.py`: a network namespace with loopback down, a mount namespace with
private tmpfs on /tmp, /var/tmp, /dev/shm and closed home directories, the interpreter's
paths bound back read-only), reports which protections it got and which it lacks, then
serves newline-delimited JSON over stdin/stdout:

    {"op": "run", "id": 7, "code": "...", "limits": {...}, "session": null | "sid"}
    {"op": "close_session", "id": 8, "session": "sid"}

and answers one line per request, `{"id": 7, "stdout": ..., "stderr": ..., ...}`.

Every child (a one-shot cell or a long-lived session) gets: a new session and process
group, its own uid (so RLIMIT_NPROC counts only its processes, it cannot signal or read
other cells, and it cannot write root-owned paths), its own 0700 directory, which is its
working directory, HOME, and (in a mount namespace of its own) its /tmp, /var/tmp and
/dev/shm, RLIMIT_CPU/AS/NPROC/FSIZE/NOFILE/CORE, stdin from /dev/null, a minimal
environment, and a parent-death signal. When it ends, its process group and every process
of its uid are killed, so a grandchild that called setsid() does not survive it either,
and its directory is removed.
"""

import json
import os
import selectors
import shutil
import signal
import sys
import time
import traceback

import _sandbox_child  # the sibling files; sys.path[0] is this directory
import _sandbox_isolation as isolation

PR_SET_CHILD_SUBREAPER = 36
READ_CHUNK = 1 << 16
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Child:
    """A forked child and the cell it is running (one-shot) or its current cell (session)."""

    def __init__(self, pid, uid, workdir, out_fd, err_fd, session_fds=()):
        self.pid, self.uid, self.workdir = pid, uid, workdir
        self.out_fd, self.err_fd = out_fd, err_fd
        self.cmd_fd, self.ctrl_fd = session_fds if session_fds else (None, None)
        self.ctrl_buf = b""
        self.request = None
        self.exit_status = None

    def start_cell(self, request):
        self.request = request
        self.output = {self.out_fd: bytearray(), self.err_fd: bytearray()}
        self.total_bytes = 0
        self.truncated = False
        self.timed_out = False
        self.started = time.monotonic()
        self.deadline = self.started + float(request["limits"]["timeout_s"])


class ForkServer:
    def __init__(self, config, proto_out, uid_block, keep_in_tmp):
        self.config = config
        self.proto_out = proto_out
        self.selector = selectors.DefaultSelector()
        self.children = {}  # pid -> Child
        self.sessions = {}  # session id -> Child
        self.next_uid = 0
        self.next_dir = 0
        self.uid_block = uid_block  # first uid of this server's block, None without uid separation
        self.busy_uids = set()  # uids of live children and of sweeps not yet reaped
        self.sweepers = {}  # sweeper pid -> uid
        # a mount namespace per child (when the server has one) and the paths to keep in its /tmp
        self.keep_in_tmp = keep_in_tmp
        self.base_dir = os.path.join("/tmp", f"agentrl_sandbox_{os.getpid()}")
        os.makedirs(self.base_dir, mode=0o711, exist_ok=True)

    def _alloc_uid(self):
        """A uid of this server's block that no live child (or pending sweep) has; offset 0 was the probe's."""
        if self.uid_block is None:
            return None
        for _ in range(isolation.UID_BLOCK):
            self.next_uid = self.next_uid % (isolation.UID_BLOCK - 1) + 1
            uid = self.uid_block + self.next_uid
            if uid not in self.busy_uids:
                self.busy_uids.add(uid)
                return uid
        raise RuntimeError(f"all {isolation.UID_BLOCK - 1} uids of this fork server are in use "
                           "(too many open sessions); close sessions or add servers")

    def _spawn(self, limits, session, code=None):
        uid = self._alloc_uid()
        self.next_dir += 1
        workdir = os.path.join(self.base_dir, str(self.next_dir))
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        cmd_r, cmd_w = os.pipe() if session else (None, None)
        ctrl_r, ctrl_w = os.pipe() if session else (None, None)
        pid = os.fork()
        if pid == 0:
            try:
                _sandbox_child.enter_child(uid, workdir, self.keep_in_tmp, limits, out_w, err_w,
                                           (cmd_r, ctrl_w) if session else ())
                if session:
                    _sandbox_child.session_main()
                os._exit(_sandbox_child.exec_cell(code, _sandbox_child.fresh_namespace()))
            except BaseException:  # on the cell's stderr when it got that far, else the server's
                try:
                    traceback.print_exc()
                    sys.stderr.flush()
                finally:
                    os._exit(121)
        for fd in (out_w, err_w, cmd_r, ctrl_w):
            if fd is not None:
                os.close(fd)
        child = Child(pid, uid, workdir, out_r, err_r, (cmd_w, ctrl_r) if session else ())
        for fd in (out_r, err_r) + ((ctrl_r,) if session else ()):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, ("child", child))
        self.children[pid] = child
        return child

    # ---- requests ----
    def handle(self, request):
        try:
            self._handle(request)
        except RuntimeError as e:
            self.reply({"id": request.get("id"), "error": str(e)})

    def _handle(self, request):
        op = request.get("op")
        if op == "run" and request.get("session") is None:
            self._spawn(request["limits"], False, request["code"]).start_cell(request)
        elif op == "run":
            self._run_in_session(request)
        elif op == "close_session":
            child = self.sessions.pop(request["session"], None)
            if child is not None:
                child.closing = True
                self._kill(child)
            self.reply({"id": request["id"], "closed": child is not None})
        else:
            self.reply({"id": request.get("id"), "error": f"unknown op {op!r}"})

    def _run_in_session(self, request):
        sid = request["session"]
        child = self.sessions.get(sid)
        restarted = child is None and request.get("known_session", False)
        if child is None:
            child = self._spawn(request["limits"], session=True)
            self.sessions[sid] = child
            child.sid = sid
        child.start_cell(request)
        child.restarted = restarted
        cell = {"code": request["code"], "cpu_s": request["limits"]["cpu_s"]}
        try:
            os.write(child.cmd_fd, (json.dumps(cell) + "\n").encode())
        except OSError:  # the session died between cells; its reaping answers the request
            self._kill(child)

    def reply(self, message):
        self.proto_out.write(json.dumps(message) + "\n")
        self.proto_out.flush()

    # ---- children ----
    def _read(self, child, fd):
        limits = child.request["limits"] if child.request else None
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.selector.unregister(fd)
                return
            if limits is None:  # output between session cells is dropped
                continue
            child.total_bytes += len(data)
            room = int(limits["output_limit_bytes"]) - sum(len(b) for b in child.output.values())
            if room > 0:
                child.output[fd] += data[:room]
            if len(data) > room:
                child.truncated = True
            if child.total_bytes > int(limits["drain_limit_bytes"]):
                self._kill(child)
                return

    def _read_ctrl(self, child):
        try:
            data = os.read(child.ctrl_fd, READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(child.ctrl_fd)
            return
        child.ctrl_buf += data
        while b"\n" in child.ctrl_buf and child.request is not None:
            line, child.ctrl_buf = child.ctrl_buf.split(b"\n", 1)
            for fd in (child.out_fd, child.err_fd):
                if fd in self.selector.get_map():
                    self._read(child, fd)
            self._finish_cell(child, json.loads(line)["exit_status"])

    def _kill(self, child):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _sweep_uid(self, uid):
        """Kill every process of a cell's uid (kill(-1) spares only init and the caller)."""
        if uid is None:
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        self.sweepers[pid] = uid  # the uid is free again once its sweep is reaped

    def _finish_cell(self, child, exit_status):
        request, child.request = child.request, None
        duration = time.monotonic() - child.started
        out, err = (bytes(child.output[fd]).decode("utf-8", "replace") for fd in (child.out_fd, child.err_fd))
        if child.truncated:
            marker = f"\n[output truncated: limit of {request['limits']['output_limit_bytes']} bytes]\n"
            out, err = (out + marker, err) if len(child.output[child.out_fd]) else (out, err + marker)
        self.reply({
            "id": request["id"], "stdout": out, "stderr": err, "exit_status": exit_status,
            "timed_out": child.timed_out or exit_status == -signal.SIGXCPU,
            "duration_s": duration, "truncated": child.truncated,
            "session_restarted": bool(getattr(child, "restarted", False)),
        })

    def _reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:  # a uid sweeper or an orphan adopted as subreaper
                self.busy_uids.discard(self.sweepers.pop(pid, None))
                continue
            self._kill(child)
            self._sweep_uid(child.uid)
            for fd in (child.out_fd, child.err_fd, child.ctrl_fd):
                if fd is not None and fd in self.selector.get_map():
                    if child.request is not None and fd != child.ctrl_fd:
                        self._read(child, fd)
                    if fd in self.selector.get_map():
                        self.selector.unregister(fd)
            for fd in (child.out_fd, child.err_fd, child.ctrl_fd, child.cmd_fd):
                if fd is not None:
                    os.close(fd)
            exit_status = os.waitstatus_to_exitcode(status)
            if child.request is not None:
                self._finish_cell(child, exit_status)
            if child.cmd_fd is not None and self.sessions.get(getattr(child, "sid", None)) is child:
                del self.sessions[child.sid]
            shutil.rmtree(child.workdir, ignore_errors=True)

    def _enforce_deadlines(self):
        now = time.monotonic()
        deadlines = [c.deadline for c in self.children.values() if c.request is not None]
        for child in list(self.children.values()):
            if child.request is not None and now >= child.deadline and not child.timed_out:
                child.timed_out = True
                self._kill(child)
        return max(0.0, min(deadlines) - now) if deadlines else None

    def serve(self, proto_in):
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        os.set_blocking(proto_in, False)
        self.selector.register(proto_in, selectors.EVENT_READ, ("proto", None))
        self.selector.register(wake_r, selectors.EVENT_READ, ("wake", None))
        buffer = b""
        while True:
            timeout = self._enforce_deadlines()
            for key, _ in self.selector.select(timeout):
                if self.selector.get_map().get(key.fd) is not key:
                    continue  # unregistered (or its fd reused) earlier in this batch
                kind, child = key.data
                if kind == "proto":
                    data = os.read(proto_in, READ_CHUNK)
                    if not data:  # the pool went away: take every child down with us
                        for c in list(self.children.values()):
                            self._kill(c)
                            self._sweep_uid(c.uid)
                        shutil.rmtree(self.base_dir, ignore_errors=True)
                        return
                    buffer += data
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        self.handle(json.loads(line))
                elif kind == "wake":
                    while True:
                        try:
                            if not os.read(wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
                    self._reap()
                elif key.fd == child.ctrl_fd:
                    self._read_ctrl(child)
                else:
                    self._read(child, key.fd)


def _protections(config, uid_block):
    """Isolates this process; returns ({protection: why it is missing}, paths cells cannot read)."""
    missing = {}
    if config["isolate_network"]:
        refused = isolation.isolate_network()
        if refused:
            missing["network_namespace"] = refused
    else:
        missing["network_namespace"] = "disabled by SandboxPoolConfig.isolate_network=False"
    if config["isolate_filesystem"]:
        refused = isolation.isolate_filesystem(config["tmpfs_mb"], PACKAGE_DIR)
        if refused:
            missing["mount_namespace"] = refused
    else:
        missing["mount_namespace"] = "disabled by SandboxPoolConfig.isolate_filesystem=False"
    unreadable = []
    if uid_block is not None:
        refused, unreadable = isolation.probe_uid(uid_block, isolation.visible_paths(PACKAGE_DIR))
        if refused:
            missing["uid_separation"] = refused
    return missing, unreadable


def main():
    config = json.loads(sys.argv[1])
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # cells must not import the trainer's modules next to this file
    for module in config["preimport"]:
        try:
            __import__(module)
        except ImportError as e:
            print(f"sandbox: cannot pre-import {module}: {e}", file=sys.stderr)
    uid_block, uid_refused = None, "disabled by SandboxPoolConfig.run_as_unprivileged=False"
    if config["run_as_unprivileged"]:
        try:
            uid_block, _lock = isolation.claim_uid_block(int(config["uid_base"]))
        except OSError as e:
            uid_refused = f"no uid block: {e}"
    try:
        missing, unreadable = _protections(config, uid_block)
    except isolation.IsolationError as e:
        print(e, file=sys.stderr)
        sys.exit(3)
    if uid_block is None:
        missing["uid_separation"] = uid_refused
    _sandbox_child.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _sandbox_child.libc.prctl(_sandbox_child.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints of the server must not corrupt the protocol
    keep_in_tmp = isolation.under_tmp(isolation.visible_paths(PACKAGE_DIR))
    server = ForkServer(config, proto_out, uid_block=None if "uid_separation" in missing else uid_block,
                        keep_in_tmp=None if "mount_namespace" in missing else keep_in_tmp)
    server.reply({"ready": True, "pid": os.getpid(), "missing": missing, "unreadable": unreadable,
                  "network_isolated": "network_namespace" not in missing,
                  "filesystem_isolated": "mount_namespace" not in missing,
                  "unprivileged": server.uid_block is not None})
    server.serve(0)


if __name__ == "__main__":
    main()
