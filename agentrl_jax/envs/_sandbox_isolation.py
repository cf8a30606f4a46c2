"""Namespaces, mounts and the uid probe of the sandbox fork server (`_forkserver.py`).

The fork server imports this file as a sibling script module before it isolates itself;
the trainer never does. Everything here runs as the server (root in the usual setup).

The filesystem view the server builds, in its own mount namespace:

- empty private tmpfs on `/tmp`, `/var/tmp` and `/dev/shm`, and on every closed
  directory (one that other users cannot traverse, such as `/root`) above a path the
  interpreter needs;
- the paths the interpreter needs (its prefixes, every `sys.path` entry, the directory of
  the executable, this package's source) bound back into place read-only, wherever they
  live: a virtualenv in a home directory, conda, a uv-managed Python, a clone under /tmp.
  The binds come from directory handles opened before anything was covered, so a path
  under a covered directory cannot vanish, whatever order the paths come in;
- each child (a cell or a session) then enters a mount namespace of its own, in which its
  private directory is `/tmp`, `/var/tmp` and `/dev/shm` (with the interpreter's paths
  under /tmp bound back in): nothing one cell writes there is visible to another, and the
  directory is removed when the child ends.

When the kernel refuses a namespace (no root, no CAP_SYS_ADMIN) the reason is returned
and reported by the pool as a missing protection. A namespace that was entered but could
not be set up raises `IsolationError`: a half-built view must never serve cells.
"""

import ctypes
import errno
import fcntl
import os
import sys

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs flags of a mount -> the mount(2) flags that keep them on a read-only remount
_KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
TMP_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")
UID_BLOCK, UID_BLOCKS = 4096, 64  # uids per fork server, servers per machine
_UID_LOCK_DIRS = ("/run/agentrl_sandbox", "/var/lock/agentrl_sandbox", "/tmp/agentrl_sandbox_uids")
_libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(RuntimeError):
    """A namespace was entered but its view could not be built; the server must stop."""


def _encode(text):
    return text.encode() if text is not None else None


def mount(source, target, fstype=None, flags=0, data=None):
    """mount(2); raises OSError naming the target."""
    if _libc.mount(_encode(source), _encode(target), _encode(fstype), flags, _encode(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount({source!r} on {target!r}): {os.strerror(err)}")


def unshare(flag, name):
    """Enters a new namespace; returns None, or why the kernel refused."""
    if _libc.unshare(flag) == 0:
        return None
    err = ctypes.get_errno()
    hint = " (needs root or CAP_SYS_ADMIN)" if err == errno.EPERM else ""
    return f"unshare({name}) failed: {os.strerror(err)}{hint}"


def _within(path, root):
    return root == os.sep or path == root or path.startswith(root + os.sep)


def _outermost(paths):
    """The paths that no other path in `paths` contains, in a stable order."""
    kept = []
    for path in sorted(set(paths), key=lambda p: (p.count(os.sep), p)):
        if not any(_within(path, root) for root in kept):
            kept.append(path)
    return kept


def visible_paths(package_dir):
    """Directories the server and its cells must still read after isolation (outermost only).

    Both the spelled and the resolved form of each path are kept: a prefix reached through
    a symlink under a covered directory needs its symlink's place filled too.
    """
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable)),
                  package_dir, *sys.path}
    paths = set()
    for path in filter(None, candidates):
        path = os.path.abspath(path)
        if os.path.isfile(path):  # a zip archive on sys.path
            path = os.path.dirname(path)
        if os.path.isdir(path):
            paths.update((path, os.path.realpath(path)))
    return _outermost(paths)


def _closed_ancestor(path):
    """The top-most proper ancestor of `path` that other users cannot traverse, or None."""
    parts = path.split(os.sep)[1:]
    for depth in range(1, len(parts)):
        ancestor = os.sep + os.path.join(*parts[:depth])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _make_read_only(path):
    """Remounts the bind at `path` read-only, keeping its other flags.

    Inside a user namespace (rootless containers) a remount that drops a flag the outer
    mount has (noexec, an atime mode) is refused, so they are carried over. Read-only is a
    second line of defence (the cells' uid cannot write root-owned files anyway), so a
    refusal is logged, not fatal.
    """
    current = os.statvfs(path).f_flag
    kept = sum(ms for st, ms in _KEPT_FLAGS if current & st)
    try:
        mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)
    except OSError as e:
        print(f"sandbox: {path} stays writable in the sandbox: {e}", file=sys.stderr)


def isolate_network():
    """New network namespace (only loopback, and it is down). None, or why not."""
    return unshare(CLONE_NEWNET, "CLONE_NEWNET")


def isolate_filesystem(tmpfs_mb, package_dir):
    """Builds the server's private view (module docstring). None, or why it is missing.

    Raises IsolationError when the namespace was entered but a mount failed.
    """
    refused = unshare(CLONE_NEWNS, "CLONE_NEWNS")
    if refused:
        return refused
    old_umask = os.umask(0o022)  # mount points we create must be traversable by the cells
    try:
        # Private propagation first: without it the mounts below would leak to the host.
        mount("none", "/", None, MS_REC | MS_PRIVATE)
        visible = visible_paths(package_dir)
        tmp_roots = [path for path in TMP_ROOTS if os.path.isdir(path)]
        covers = _outermost(tmp_roots + [a for a in map(_closed_ancestor, visible) if a])
        handles = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in visible}
        for cover in covers:
            size = f"size={int(tmpfs_mb)}m,mode=1777" if cover in tmp_roots else "size=1m,mode=0755"
            mount("tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, size)
        for path, handle in handles.items():
            if not any(_within(cover, path) for cover in covers):  # never bind over a cover
                os.makedirs(path, mode=0o755, exist_ok=True)
                mount(f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC)
                _make_read_only(path)
            os.close(handle)
        missing = [path for path in visible if not os.path.isdir(path)]
        if missing:
            raise OSError(errno.ENOENT, f"still hidden after the binds: {missing}")
    except OSError as e:
        raise IsolationError(f"sandbox: could not build the private filesystem view: {e}") from e
    finally:
        os.umask(old_umask)
    return None


def under_tmp(paths):
    """The paths that a child's private /tmp would hide (an interpreter in a CI clone under /tmp)."""
    return [path for path in paths if any(_within(path, root) for root in TMP_ROOTS)]


def private_tmp(workdir, keep):
    """In a forked child (still root): its own mount namespace, `workdir` on every tmp root.

    `keep` (the interpreter's paths under a tmp root, already read-only binds) is bound
    back inside. Returns the path under which the child now sees `workdir` (`/tmp`).
    """
    refused = unshare(CLONE_NEWNS, "CLONE_NEWNS")
    if refused:
        raise OSError(errno.EPERM, refused)
    handles = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in [workdir, *keep]}
    for root in TMP_ROOTS:
        if os.path.isdir(root):
            mount(f"/proc/self/fd/{handles[workdir]}", root, None, MS_BIND)
    for path in keep:
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{handles[path]}", path, None, MS_BIND | MS_REC)
    for handle in handles.values():
        os.close(handle)
    return TMP_ROOTS[0]


def claim_uid_block(uid_base):
    """(first uid, lock fd) of a block of UID_BLOCK uids no other fork server on the host holds.

    Two servers drawing the same uid would kill each other's cells (every process of a
    finished cell's uid is killed) and could signal each other's sessions. A block is an
    flock on a file in a root-only directory, held for the server's life and released by
    the kernel when it dies. Runs before isolation (a /tmp fallback must be the host's).
    Raises OSError when no directory is writable or every block is held.
    """
    for directory in _UID_LOCK_DIRS:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            break
        except OSError:
            continue
    else:
        raise OSError(errno.EACCES, f"no writable directory for uid locks among {_UID_LOCK_DIRS}")
    for block in range(UID_BLOCKS):
        fd = os.open(os.path.join(directory, f"uids_{uid_base}_{block}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid_base + block * UID_BLOCK, fd
    raise OSError(errno.EAGAIN, f"all {UID_BLOCKS} uid blocks above {uid_base} are held by other fork servers")


def probe_uid(uid, paths):
    """Forks a child that becomes `uid` and reads `paths`, as a cell would.

    Returns (why uid separation is impossible or None, the paths that uid cannot read).
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            unreadable = [p for p in paths if not os.access(p, os.R_OK | os.X_OK)]
            os.write(write_fd, "\n".join(unreadable).encode())
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        report = reader.read().decode()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return f"a child cannot switch to uid {uid} (needs root, or CAP_SETUID and CAP_SETGID)", []
    return None, [line for line in report.split("\n") if line]
