"""Remote (SandboxFusion HTTP) backend against a local run_code server backed by the real pool."""

import asyncio
import http.server
import json
import threading

import pytest

from agentrl_jax.envs.remote_sandbox import RemoteSandbox, RemoteSandboxConfig


class FakeSandboxFusion:
    """127.0.0.1 server implementing POST /run_code with the pool; the first `fail_first` calls 503."""

    def __init__(self, loop_thread, pool, fail_first=0):
        self.requests, self.fail_first = [], fail_first
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if self.path != "/run_code":
                    return self.send_error(404)
                if len(outer.requests) <= outer.fail_first:
                    return self.send_error(503)
                result = loop_thread.run(pool.run(body["code"], timeout_s=body["run_timeout"]))
                status = "TimeLimitExceeded" if result.timed_out else "Finished"
                payload = {"status": "Success" if result.ok else "Failed", "message": "",
                           "compile_result": None, "files": {},
                           "run_result": {"status": status, "execution_time": result.duration_s,
                                          "return_code": result.exit_status, "stdout": result.stdout,
                                          "stderr": result.stderr}}
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_server(loop_thread, pool):
    server = FakeSandboxFusion(loop_thread, pool)
    yield server
    server.close()


def run(coro):
    return asyncio.run(coro)


def test_remote_run_matches_schema_and_results(fake_server):
    remote = RemoteSandbox(RemoteSandboxConfig(fake_server.url, timeout_s=2.0, backoff_s=0.01))
    ok = run(remote.run("print(6 * 7)"))
    bad = run(remote.run("raise KeyError('k')"))
    slow = run(remote.run("while True:\n    pass", timeout_s=1.0))
    assert ok.ok and ok.stdout == "42\n"
    assert bad.exit_status == 1 and "KeyError" in bad.stderr
    assert slow.timed_out
    body = fake_server.requests[0]
    assert body["language"] == "python" and body["run_timeout"] == 2.0 and "memory_limit_MB" in body
    assert remote.metrics()["remote_sandbox/executions"] == 3


def test_remote_retries_with_backoff(loop_thread, pool):
    server = FakeSandboxFusion(loop_thread, pool, fail_first=2)
    try:
        remote = RemoteSandbox(RemoteSandboxConfig(server.url, max_retries=3, backoff_s=0.01))
        result = run(remote.run("print('after retries')"))
        assert result.ok and result.stdout == "after retries\n"
        assert remote.metrics()["remote_sandbox/retries"] == 2 and len(server.requests) == 3
    finally:
        server.close()


def test_remote_gives_up_with_error_not_exception():
    remote = RemoteSandbox(RemoteSandboxConfig("http://127.0.0.1:9", max_retries=1, backoff_s=0.01))
    result = run(remote.run("print(1)"))
    assert result.error is not None and "remote sandbox" in result.error and not result.ok


def test_remote_session_replays_state(fake_server):
    async def scenario():
        remote = RemoteSandbox(RemoteSandboxConfig(fake_server.url, max_concurrency=2))
        await remote.run("x = 20\nprint('set')", session="s")
        second = await remote.run("x += 1\nprint(x)", session="s")
        other = await remote.run("print('x' in globals())", session="t")
        await remote.close_session("s")
        return second, other

    second, other = run(scenario())
    assert second.stdout == "21\n" and other.stdout == "False\n"
