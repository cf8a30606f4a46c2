"""The entry point: `python launch/tpu_pod.py --config configs/demo.py [--set key=value ...]`.

Runs on one host (CPU, GPU or TPU VM) or on every host of a TPU pod slice / GPU cluster.
On a Cloud TPU pod every worker runs the same command (`gcloud ... ssh --worker=all`);
`jax.distributed.initialize()` discovers the coordinator from the TPU metadata (and under
SLURM from its variables). Elsewhere pass `--coordinator HOST:PORT --num-processes N
--process-id I` on each host. docs/multihost.md has the cluster commands.

`--config` takes a path or a bare name from configs/ (`--config retool`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config file (path, or a name in configs/); required unless --describe")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optimizer.learning_rate=1e-6 (repeatable)")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (multi-host, not on Cloud TPU)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() with auto-detection (Cloud TPU pods, SLURM)")
    p.add_argument("--local-device-ids", default=None, metavar="0,1,...",
                   help="the GPUs this process drives (multi-host; default: all it sees, but under SLURM "
                        "JAX's default is the one GPU of SLURM_LOCALID: one process per node needs the list)")
    p.add_argument("--describe", action="store_true", help="print every config field with its doc and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # orbax and grain log every file they touch through absl at INFO.
    logging.getLogger("absl").setLevel(logging.WARNING)
    from agentrl_jax.config import ConfigError, describe, load_config

    if args.describe:
        print(describe())
        return 0
    if not args.config:
        print("error: --config is required (a path, or a name in configs/ such as demo)", file=sys.stderr)
        return 2
    import jax

    local = None
    if args.local_device_ids and not (args.coordinator or args.distributed):
        print("error: --local-device-ids applies to jax.distributed: pass --coordinator or --distributed too",
              file=sys.stderr)
        return 2
    if args.local_device_ids:
        try:
            local = [int(i) for i in args.local_device_ids.split(",")]
        except ValueError:
            print(f"error: --local-device-ids {args.local_device_ids!r}: expected integers separated by commas",
                  file=sys.stderr)
            return 2
    if args.coordinator:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id, local_device_ids=local)
    elif args.distributed:
        jax.distributed.initialize(local_device_ids=local)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from agentrl_jax.data import DataError
    from agentrl_jax.train.run import train

    try:
        train(config)
    except (ConfigError, DataError) as e:
        # What only the run can check (a data file, a checkpoint directory, the mesh against the
        # devices, the fields of the tasks) is a setting to change, not a bug: one line, as at load.
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
