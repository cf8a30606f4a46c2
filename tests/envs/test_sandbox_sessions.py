"""Stateful sandbox sessions: state across cells, isolation, limits and cleanup."""

import asyncio


def test_session_keeps_state_and_sessions_are_isolated(loop_thread, pool):
    async def scenario():
        a1 = await pool.run("x = 40\nimport numpy as np\narr = np.arange(4)", session="traj-a")
        b1 = await pool.run("x = 'b'", session="traj-b")
        a2 = await pool.run("x += 2\nprint(x, arr.sum())", session="traj-a")
        b2 = await pool.run("print(x)\nprint(globals().get('arr'))", session="traj-b")
        fresh = await pool.run("print('x' in globals())")
        return a1, b1, a2, b2, fresh

    a1, b1, a2, b2, fresh = loop_thread.run(scenario())
    assert a1.ok and b1.ok, (a1, b1)
    assert a2.stdout == "42 6\n"
    assert b2.stdout == "b\nNone\n"
    assert fresh.stdout == "False\n"


def test_session_cell_error_keeps_namespace(loop_thread, pool):
    async def scenario():
        await pool.run("y = 5", session="err")
        bad = await pool.run("1 / 0", session="err")
        after = await pool.run("print(y)", session="err")
        await pool.close_session("err")
        return bad, after

    bad, after = loop_thread.run(scenario())
    assert bad.exit_status == 1 and "ZeroDivisionError" in bad.stderr
    assert after.ok and after.stdout == "5\n" and not after.session_restarted


def test_session_timeout_restarts_with_fresh_state(loop_thread, pool):
    async def scenario():
        await pool.run("z = 1", session="slow")
        hung = await pool.run("while True:\n    pass", session="slow", timeout_s=1.0)
        after = await pool.run("print('z' in globals())", session="slow")
        await pool.close_session("slow")
        return hung, after

    hung, after = loop_thread.run(scenario())
    assert hung.timed_out
    assert after.ok and after.stdout == "False\n" and after.session_restarted


def test_session_memory_limit(loop_thread, pool):
    async def scenario():
        big = await pool.run("x = bytearray(3 * 1024**3)", session="mem", memory_mb=128)
        small = await pool.run("y = bytearray(10**6)\nprint(len(y))", session="mem")
        await pool.close_session("mem")
        return big, small

    big, small = loop_thread.run(scenario())
    assert "MemoryError" in big.stderr
    assert small.ok and small.stdout == "1000000\n"


def test_close_session_ends_state(loop_thread, pool):
    async def scenario():
        await pool.run("w = 3", session="closing")
        await pool.close_session("closing")
        return await pool.run("print('w' in globals())", session="closing")

    result = loop_thread.run(scenario())
    assert result.stdout == "False\n"


def test_cells_of_one_session_run_in_order(loop_thread, pool):
    async def scenario():
        await pool.run("log = []", session="order")
        await asyncio.gather(*(pool.run(f"log.append({i})", session="order") for i in range(6)))
        out = await pool.run("print(log)", session="order")
        await pool.close_session("order")
        return out

    assert loop_thread.run(scenario()).stdout == "[0, 1, 2, 3, 4, 5]\n"
