#!/usr/bin/env bash
# GRPO vs PPO with a critic on the demo, several seeds, every run concurrent (one process each, on
# one machine or one GPU), then a table and a plot (bench/critic_compare.py summary).
#   bash bench/critic_compare.sh OUT_DIR [SEED ...]                 (default seeds: 0 1 2)
# Arms (ARMS, default "grpo ppo1 ppo8"), at the same number of episodes per step (64), so the same
# sampled tokens up to response lengths (the summary prints each arm's total):
#   grpo  algorithm.advantage=grpo, 8 prompts x G=8 (the demo as configured)
#   ppo1  algorithm.advantage=gae (a critic), 64 prompts x 1 sample
#   ppo8  algorithm.advantage=gae, 8 prompts x 8 samples
# CONFIG defaults to configs/demo.py; EXTRA adds --set overrides to every run (e.g. EXTRA="total_steps=1").
# On a GPU each process gets 0.9 / (number of runs) of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set).
set -euo pipefail
out=${1:?usage: bench/critic_compare.sh OUT_DIR [SEED ...]}; shift
seeds=${*:-0 1 2}
arms=${ARMS:-grpo ppo1 ppo8}
config=${CONFIG:-configs/demo.py}
here=$(dirname "$0")
declare -A arm_sets=(
  [grpo]="algorithm.advantage=grpo algorithm.group_size=8 data.prompts_per_step=8"
  [ppo1]="algorithm.advantage=gae algorithm.group_size=1 data.prompts_per_step=64"
  [ppo8]="algorithm.advantage=gae algorithm.group_size=8 data.prompts_per_step=8"
)
runs=$(( $(echo $seeds | wc -w) * $(echo $arms | wc -w) ))
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(python3 -c "print(round(0.9 / $runs, 3))")}
mkdir -p "$out"
for arm in $arms; do
  [[ -n "${arm_sets[$arm]:-}" ]] || { echo "unknown arm $arm (known: ${!arm_sets[*]})" >&2; exit 2; }
  for s in $seeds; do
    sets=(--set seed=$s --set output_dir="$out/$arm/seed$s")
    for item in ${arm_sets[$arm]} ${EXTRA:-}; do sets+=(--set "$item"); done
    python3 "$here/critic_compare.py" run --config "$config" "${sets[@]}" > "$out/$arm-seed$s.log" 2>&1 &
  done
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
python3 "$here/critic_compare.py" summary "$out" --arms $arms --seeds $seeds --plot "$out/critic_compare.png"
exit $status
