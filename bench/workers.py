"""What the benches that measure in worker processes share."""

from __future__ import annotations

import signal
import sys


def stop_workers_with_the_bench() -> None:
    """Make SIGTERM stop this bench's worker process too.

    `timeout`, SLURM and time-limited job runners stop a bench with SIGTERM. By default the
    bench dies at once while the worker it waits on keeps running and holding its GPU, and the
    next job on that card fails to allocate (XLA's allocator aborts). Raised as SystemExit
    instead, the signal unwinds `subprocess.run`, which kills its child on the way out.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
