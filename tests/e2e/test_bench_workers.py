"""A bench stopped with SIGTERM (`timeout`, SLURM) stops its worker too: a worker left running
holds its GPU, and the next job on that card fails to allocate."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # exited meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after "(comm)": the parent
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_to_a_bench_stops_its_worker():
    bench = subprocess.Popen([sys.executable, "bench/train_scaling.py", "--tiny", "--gpus", "1"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.time() + 60
        while not workers and time.time() < deadline and bench.poll() is None:
            time.sleep(0.2)
            workers = _children(bench.pid)
        assert workers, "the bench started no worker within 60 s"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.time() + 10
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), f"worker(s) {workers} outlived the bench"
    finally:  # nothing of a failed run left behind
        bench.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
