#!/usr/bin/env bash
# A config for several seeds at once (one process each, on one machine or one GPU), then a table
# of held-out pass@1 / tool use before (SFT) and after RL per seed, with mean and spread.
#   bash bench/demo_seeds.sh OUT_DIR [SEED ...]                  (default seeds: 0 1 2)
#   CONFIG=configs/retool_small.py bash bench/demo_seeds.sh OUT_DIR 0 1 2
# CONFIG defaults to configs/demo.py. On a GPU each process gets 0.9 / (number of seeds) of its
# memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set). seeds_summary.py --plots draws the curves.
set -euo pipefail
out=${1:?usage: bench/demo_seeds.sh OUT_DIR [SEED ...]}; shift
seeds=${*:-0 1 2}
config=${CONFIG:-configs/demo.py}
n=$(echo $seeds | wc -w)
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(python3 -c "print(round(0.9 / $n, 3))")}
mkdir -p "$out"
for s in $seeds; do
  python3 launch/tpu_pod.py --config "$config" --set seed=$s --set output_dir="$out/seed$s" \
    > "$out/seed$s.log" 2>&1 &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
python3 "$(dirname "$0")/seeds_summary.py" "$out" $seeds
exit $status
