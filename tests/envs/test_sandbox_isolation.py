"""What a cell can see: the interpreter wherever it lives, never another cell's files.

Also: a fork server that cannot start says why, and a machine without the privileges for
uid separation and namespaces is reported (and refused when asked) at pool start.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from agentrl_jax.envs.sandbox import SandboxPoolConfig, SandboxPool

REPO = Path(__file__).resolve().parents[2]
WRITE = ("import os\nfor path in ('/tmp/x', os.path.expanduser('~/y'), '/var/tmp/z', '/dev/shm/w'):\n"
         "    open(path, 'w').write('secret')\nprint(os.listdir('/tmp'))")
READ = ("import os\nprint([os.path.exists(p) for p in "
        "('/tmp/x', os.path.expanduser('~/y'), '/var/tmp/z', '/dev/shm/w')])")


def server_dirs(pool):
    """The per-child directories of the pool's (single) fork server, seen inside its mount namespace."""
    pid = pool._servers[0].info["pid"]
    return os.listdir(f"/proc/{pid}/root/tmp/agentrl_sandbox_{pid}")


def wait_until_empty(pool, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while server_dirs(pool) and time.monotonic() < deadline:
        time.sleep(0.05)
    return server_dirs(pool)


def test_tmp_and_home_are_private_per_cell_and_session(loop_thread, pool):
    if not pool.filesystem_isolated:
        pytest.skip(f"no mount namespace here: {pool.protections_missing}")

    async def scenario():
        wrote = await pool.run(WRITE)
        cell_after = await pool.run(READ)
        in_session = await pool.run(WRITE, session="episode-1")
        same_session = await pool.run(READ, session="episode-1")
        dirs_during = server_dirs(pool)
        other_session = await pool.run(READ, session="episode-2")
        await pool.close_session("episode-1")
        await pool.close_session("episode-2")
        return wrote, cell_after, in_session, same_session, dirs_during, other_session

    wrote, cell_after, in_session, same_session, dirs_during, other_session = loop_thread.run(scenario())
    assert wrote.ok and in_session.ok, (wrote, in_session)
    assert cell_after.stdout == "[False, False, False, False]\n", cell_after
    assert same_session.stdout == "[True, True, True, True]\n"  # a session keeps its own files
    assert other_session.stdout == "[False, False, False, False]\n", other_session
    assert len(dirs_during) == 1  # the open session's directory; the cells' are gone
    assert wait_until_empty(pool) == []


def test_episodes_of_the_retool_env_do_not_share_tmp(loop_thread, pool):
    from agentrl_jax.envs import ReToolConfig, ReToolEnv
    from agentrl_jax.rewards import MathVerifier

    def cell(body):
        return f"<code>\n```python\n{body}\n```\n</code>"

    async def episode(env, body):
        await env.reset({"question": "q", "answer": "1"})
        step = await env.step(cell(body))
        await env.close()
        return step.observation_text

    with MathVerifier(timeout_s=5.0) as verifier:
        env = ReToolEnv(pool, verifier, ReToolConfig())
        first = loop_thread.run(episode(env, "open('/tmp/note', 'w').write('from episode 1')\nprint('written')"))
        second = loop_thread.run(episode(env, "print(open('/tmp/note').read())"))
    assert "written" in first
    if pool.filesystem_isolated:
        assert "FileNotFoundError" in second and "from episode 1" not in second, second
    else:
        pytest.skip(f"no mount namespace here: {pool.protections_missing}")


def test_retool_sessions_get_the_configured_memory_limit(loop_thread):
    from agentrl_jax.config import load_config
    from agentrl_jax.rewards import MathVerifier
    from agentrl_jax.envs import make_sandbox
    from agentrl_jax.train.setup import env_factory

    config = load_config("retool", ["environment.sandbox.memory_mb=64", "environment.sandbox.workers=2",
                                    "model.path=unused", "data.train_path=unused", "data.eval_path=unused"])
    sandbox = make_sandbox(config)

    async def episode(make_env):
        async with sandbox:
            env = make_env()
            await env.reset({"question": "q", "answer": "1"})
            big = await env.step("<code>\n```python\nx = bytearray(200 * 2**20)\nprint('allocated')\n```\n</code>")
            small = await env.step("<code>\n```python\ny = bytearray(16 * 2**20)\nprint(len(y))\n```\n</code>")
            await env.close()
            return big.observation_text, small.observation_text

    with MathVerifier(timeout_s=5.0) as verifier:
        big, small = loop_thread.run(episode(env_factory(config, sandbox, verifier)))
    assert "MemoryError" in big and "allocated" not in big, big
    assert str(16 * 2**20) in small, small


@pytest.mark.parametrize("where", ["home", "tmp"])
def test_virtualenv_in_a_home_directory_or_under_tmp(tmp_path, where):
    """A venv below a closed directory ($HOME of root, next to a base Python that may be there
    too), or under /tmp (a CI clone), which the sandbox covers with its private tmpfs.

    The fork server runs on the venv's interpreter; a cell imports a package that only the
    venv has (not pre-imported, so it must still be visible after isolation) and numpy from
    a site directory the venv reaches through a .pth file. A second .pth entry is a 0700
    directory: the pool warns that the cells' uid cannot read it.
    """
    home = (Path.home() if where == "home" else tmp_path) / f".agentrl_test_{uuid.uuid4().hex[:8]}"
    try:
        venv = home / "envs" / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        python = venv / "bin" / "python"
        site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        (site / "agentrl_probe_pkg").mkdir()
        (site / "agentrl_probe_pkg" / "__init__.py").write_text("VALUE = 'from the venv'\n")
        import numpy

        private = home / "private_site"
        private.mkdir(mode=0o700)
        (site / "host_site.pth").write_text(f"{Path(numpy.__file__).parents[1]}\n{private}\n")
        script = textwrap.dedent("""
            import asyncio, json
            from agentrl_jax.envs.sandbox import SandboxPoolConfig, SandboxPool

            async def main():
                async with SandboxPool(SandboxPoolConfig(preimport=(), timeout_s=20)) as pool:
                    result = await pool.run("import sys, agentrl_probe_pkg, numpy\\n"
                                            "print(agentrl_probe_pkg.VALUE, numpy.arange(3).sum(), sys.prefix)")
                    print(json.dumps([result.stdout, result.stderr, pool.filesystem_isolated]))

            asyncio.run(main())
        """)
        done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=240, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr[-3000:]
        stdout, stderr, isolated = json.loads(done.stdout.strip().splitlines()[-1])
        assert stdout == f"from the venv 3 {venv}\n", stderr
        assert isolated or os.getuid() != 0
        if os.getuid() == 0:
            assert f"the cells' uid cannot read {private}" in done.stderr, done.stderr[-3000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_failed_start_says_why(loop_thread, tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: no module named encodings' >&2\nexit 7\n")
    broken.chmod(0o755)
    pool = SandboxPool(SandboxPoolConfig(python=str(broken)))
    with pytest.raises(RuntimeError, match=r"(?s)failed to start.*no module named encodings"):
        loop_thread.run(pool.start())


PRIVILEGE_DROP = textwrap.dedent("""
    import asyncio, ctypes, json, logging, sys
    PR_CAPBSET_DROP, CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN = 24, 6, 7, 21
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN):  # gone for every program we exec
        assert libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0, ctypes.get_errno()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from agentrl_jax.envs.sandbox import SandboxPoolConfig, SandboxIsolationError, SandboxPool

    async def main():
        report = {}
        async with SandboxPool(SandboxPoolConfig(preimport=())) as pool:
            result = await pool.run("import os; print(os.getuid())")
            report.update(missing=sorted(pool.protections_missing), ok=result.ok, uid=result.stdout,
                          count=pool.metrics()["sandbox/protections_missing"])
        try:
            await SandboxPool(SandboxPoolConfig(preimport=(), require_isolation=True)).start()
        except SandboxIsolationError as e:
            report["refused"] = str(e)
        print(json.dumps(report))

    asyncio.run(main())
""")


@pytest.mark.skipif(os.getuid() != 0, reason="dropping capabilities from the bounding set needs root")
def test_missing_protections_are_reported_counted_and_refused(tmp_path):
    done = subprocess.run([sys.executable, "-c", PRIVILEGE_DROP], capture_output=True, text=True, timeout=240,
                          check=False, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["missing"] == ["mount_namespace", "network_namespace", "uid_separation"]
    assert report["count"] == 3.0
    assert report["ok"] and report["uid"] == "0\n"  # the cells still run, as the trainer's user
    for name in report["missing"]:
        assert f"sandbox: no {name}" in done.stderr
    assert "CAP_SYS_ADMIN" in done.stderr and "CAP_SETUID" in done.stderr
    assert "environment.sandbox.require_isolation" in report["refused"]


def test_a_disabled_protection_is_refused_when_isolation_is_required(loop_thread):
    from agentrl_jax.config import load_config
    from agentrl_jax.envs.sandbox import SandboxIsolationError
    from agentrl_jax.envs import make_sandbox

    config = load_config("demo", ["environment.sandbox.require_isolation=true"])
    assert make_sandbox(config).config.require_isolation
    pool = SandboxPool(SandboxPoolConfig(preimport=(), isolate_network=False, require_isolation=True))
    with pytest.raises(SandboxIsolationError, match=r"network_namespace: disabled by SandboxPoolConfig.isolate_network"):
        loop_thread.run(pool.start())
    assert all(server is None or not server.alive for server in pool._servers)  # nothing left running


def test_two_fork_servers_never_share_a_uid(loop_thread, pool):
    """Each server holds its own uid block: a cell ending on one never kills another's session."""
    other = SandboxPool(SandboxPoolConfig(preimport=()))

    async def scenario():
        await other.start()
        try:
            first = await pool.run("import os\nstate = 7\nprint(os.getuid())", session="long-episode")
            elsewhere = [await other.run("import os; print(os.getuid())") for _ in range(3)]
            later = await pool.run("print(state)", session="long-episode")
        finally:
            await pool.close_session("long-episode")
            await other.close()
        return first, elsewhere, later

    first, elsewhere, later = loop_thread.run(scenario())
    if "uid_separation" in pool.protections_missing:
        pytest.skip(f"no uid separation here: {pool.protections_missing['uid_separation']}")
    assert first.ok and all(r.ok for r in elsewhere)
    assert first.stdout not in {r.stdout for r in elsewhere}
    assert later.ok and later.stdout == "7\n" and not later.session_restarted, later
