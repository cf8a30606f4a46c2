"""Hostile code against the sandbox pool: each attack is contained and the pool keeps serving."""

import os
import socket
import threading
import time

import pytest

SECRET = "agentrl-test-secret-4242"


def check_pool_serves(loop_thread, pool):
    result = loop_thread.run(pool.run("print(6 * 7)"))
    assert result.ok and result.stdout == "42\n", result


def run(loop_thread, pool, code, **kw):
    return loop_thread.run(pool.run(code, **kw))


def test_trivial_and_exception(loop_thread, pool):
    check_pool_serves(loop_thread, pool)
    result = run(loop_thread, pool, "raise ValueError('boom')")
    assert result.exit_status == 1 and "ValueError: boom" in result.stderr and not result.timed_out


def test_infinite_loop_times_out(loop_thread, pool):
    start = time.monotonic()
    result = run(loop_thread, pool, "while True:\n    pass", timeout_s=1.0)
    assert result.timed_out and result.exit_status is not None and result.exit_status < 0
    assert time.monotonic() - start < 3.0
    check_pool_serves(loop_thread, pool)


def test_sleeping_cell_hits_wall_clock_not_cpu(loop_thread, pool):
    result = run(loop_thread, pool, "import time\ntime.sleep(30)", timeout_s=1.0)
    assert result.timed_out and result.duration_s < 3.0


def test_fork_bomb_is_contained(loop_thread, pool):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run(loop_thread, pool, code, timeout_s=1.5)
    assert result.timed_out or result.exit_status != 0
    check_pool_serves(loop_thread, pool)
    uid = int(run(loop_thread, pool, code.replace("import os", "import os\nprint(os.getuid(), flush=True)"),
                  timeout_s=1.0).stdout.split()[0])
    assert wait_no_processes_of_uid(uid) == []  # no process of either bomb survives


def test_memory_bomb_is_contained(loop_thread, pool):
    result = run(loop_thread, pool, "x = bytearray(4 * 1024**3)\nprint('allocated')")
    assert result.exit_status != 0 and "allocated" not in result.stdout
    assert "MemoryError" in result.stderr
    result = run(loop_thread, pool, "x = []\nwhile True:\n    x.append(bytearray(10**7))")
    assert result.exit_status != 0 and not result.ok
    check_pool_serves(loop_thread, pool)


def test_100mb_of_output_is_truncated(loop_thread, pool):
    start = time.monotonic()
    result = run(loop_thread, pool, "import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 2**20)")
    assert result.truncated and "[output truncated" in result.stdout
    assert len(result.stdout) < 4096 + 200
    assert time.monotonic() - start < 3.0
    check_pool_serves(loop_thread, pool)


def test_os_exit_reports_status(loop_thread, pool):
    result = run(loop_thread, pool, "import os\nprint('bye', flush=True)\nos._exit(7)")
    assert result.exit_status == 7 and result.stdout == "bye\n" and not result.timed_out


def test_kill_parent_cannot_touch_the_trainer(loop_thread, pool):
    trainer_pid = os.getpid()
    result = run(loop_thread, pool, f"import os\nos.kill(os.getppid(), 9)\nos.kill({trainer_pid}, 9)")
    assert result.exit_status != 0 or result.error is not None
    assert os.getpid() == trainer_pid  # we are still here
    check_pool_serves(loop_thread, pool)


def test_writes_outside_workdir_fail_or_are_confined(loop_thread, pool, tmp_path):
    result = run(loop_thread, pool, "open('/etc/agentrl_escape', 'w').write('x')")
    assert result.exit_status == 1 and "PermissionError" in result.stderr
    assert not os.path.exists("/etc/agentrl_escape")
    target = tmp_path / "escape.txt"
    os.chmod(tmp_path, 0o777)
    result = run(loop_thread, pool, f"open({str(target)!r}, 'w').write('x')\nprint(open({str(target)!r}).read())")
    if pool.filesystem_isolated:  # the cell's /tmp is a private tmpfs: the write lands there
        assert not target.exists()
    else:
        pytest.skip("no mount namespace: world-writable host paths stay writable")
    cwd = run(loop_thread, pool, "import os\nopen('agentrl_local.txt', 'w').write('ok')\nprint(os.getcwd())")
    # the working directory is the cell's private /tmp (test_sandbox_isolation.py checks its removal)
    assert cwd.ok and cwd.stdout == "/tmp\n" and not os.path.exists("/tmp/agentrl_local.txt")


def test_environment_secrets_are_scrubbed(loop_thread, pool, monkeypatch):
    monkeypatch.setenv("AGENTRL_SECRET_TOKEN", SECRET)
    code = ("import os\nprint(SECRET in repr(dict(os.environ)))\n"
            f"try:\n    print(SECRET in open('/proc/{os.getpid()}/environ').read())\n"
            "except OSError as e:\n    print('denied', type(e).__name__)")
    result = run(loop_thread, pool, f"SECRET = {SECRET!r}\n" + code)
    assert result.ok, result
    assert result.stdout.splitlines()[0] == "False"
    assert result.stdout.splitlines()[1].startswith("denied")


def test_loopback_socket_is_blocked(loop_thread, pool):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    result = run(loop_thread, pool, code)
    server.close()
    if not pool.network_isolated:
        pytest.skip("network namespace unavailable: reported as network_isolated=False")
    assert result.network_isolated and "connected" not in result.stdout and not accepted
    assert "OSError" in result.stderr or "Error" in result.stderr


def processes_of_uid(uid):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            found.append(pid)
    return found


def wait_no_processes_of_uid(uid, within_s=1.0):
    deadline = time.monotonic() + within_s
    while processes_of_uid(uid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return processes_of_uid(uid)


def test_orphaned_grandchild_is_killed(loop_thread, pool):
    # The grandchild leaves the process group (setsid) and would sleep on after the
    # cell exits; the sweep of the cell's uid must kill it.
    code = ("import os, time\nprint(os.getuid(), flush=True)\nif os.fork() == 0:\n    os.setsid()\n"
            "    time.sleep(30)\n    os._exit(0)\n")
    result = run(loop_thread, pool, code)
    assert result.ok, result
    uid = int(result.stdout.split()[0])
    if uid == 0:
        pytest.skip("cells run as root (not unprivileged): only the process group is killed")
    assert wait_no_processes_of_uid(uid) == []


def test_background_subprocess_is_killed(loop_thread, pool):
    result = run(loop_thread, pool, "import subprocess\nsubprocess.Popen(['sleep', '37.5'], start_new_session=True)\n"
                                    "print('spawned')")
    assert result.ok
    time.sleep(0.3)
    import subprocess

    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "sleep 37.5" not in ps


def test_deep_recursion(loop_thread, pool):
    result = run(loop_thread, pool, "def f(n):\n    return f(n + 1)\nf(0)")
    assert result.exit_status == 1 and "RecursionError" in result.stderr
    result = run(loop_thread, pool, "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)",
                 timeout_s=1.5)
    assert not result.ok
    check_pool_serves(loop_thread, pool)


def test_killing_the_fork_server_is_recovered(loop_thread, pool):
    server_pid = pool._servers[0].info["pid"]
    os.kill(server_pid, 9)
    time.sleep(0.1)
    check_pool_serves(loop_thread, pool)
    assert pool.metrics()["sandbox/servers_replaced"] >= 1


def test_concurrent_executions_and_metrics(loop_thread, pool):
    import asyncio

    async def many():
        return await asyncio.gather(*(pool.run(f"print({i} * 2)") for i in range(20)))

    results = loop_thread.run(many())
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(20)]
    metrics = pool.metrics()
    assert metrics["sandbox/executions"] >= 20 and metrics["sandbox/latency_p99_s"] >= metrics["sandbox/latency_p50_s"]
