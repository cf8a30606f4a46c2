#!/usr/bin/env bash
# The hindsight-OPD ablation on SmolLM2-135M-Instruct (protocol: docs/hybrid.md, "On the real model"), on one
# GPU in one command, in the protocol's order:
#   1. every seed's SFT once (configs/smollm2_hybrid.py, exported; every arm of a seed starts from it);
#   2. the step-0 diagnostic on each seed's SFT policy (bench/hint_diagnostic_programs.py), before any arm;
#   3. the arms grpo, hybrid_lam0.1, hybrid_lam0.3, placebo from those exports, then the table and the plot;
#   4. a probe, not an arm: the policy prompted as its own judge for 2 RL steps on seed 0 (its judge/* metrics).
#   bash bench/hybrid_smollm2.sh OUT_DIR GGUF_FILE [SEED ...]          (default seeds: 0 1 2 3 4)
# JOBS (default 4) processes at once (JOBS=6 with EXTRA_ARMS="ppo1 lora_r16"), each with 0.9 / JOBS of the GPU's memory (the SFTs: 0.9 / the SFTs at once);
# DEADLINE (seconds, optional): no run starts after it (run the command again to continue: finished runs and
# exports are reused).
set -euo pipefail
out=${1:?usage: bench/hybrid_smollm2.sh OUT_DIR GGUF_FILE [SEED ...]}
gguf=${2:?usage: bench/hybrid_smollm2.sh OUT_DIR GGUF_FILE [SEED ...]}
shift 2
seeds=${*:-0 1 2 3 4}
jobs=${JOBS:-4}
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(python3 -c "print(round(0.9 / $jobs, 3))")}
mkdir -p "$out"
python3 -c "import sys; from agentrl_jax.models.gguf_cache import hf_directory; hf_directory(sys.argv[1])" "$gguf"
start=$(date +%s)
left() { [ -z "${DEADLINE:-}" ] && return 0; echo $((DEADLINE - $(date +%s) + start)); }
ablation=(python3 bench/hybrid_ablation.py --config configs/smollm2_hybrid.py --out "$out" --jobs "$jobs"
          --set "model.path=$gguf" --set "rollout.compilation_cache_dir=$out/xla_cache")
deadline() { [ -z "${DEADLINE:-}" ] || echo --deadline "$(left)"; }
# 1. the SFTs (their own start evaluation only marks them finished: a token one, no rollout warm-up; every arm
#    evaluates its start, the same policy, on the protocol's 64 x 4)
nseeds=$(echo $seeds | wc -w)
XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / min($jobs, $nseeds), 3))") \
  "${ablation[@]}" --seeds $seeds --arms --set rollout.warmup=off --set eval.num_tasks=4 --set eval.samples_per_task=1 \
  $(deadline)
# 2. the diagnostic, all seeds at once (forward passes only)
for s in $seeds; do
  if [ -f "$out/seed$s/sft/export/config.json" ] && [ ! -f "$out/diagnostic_seed$s.json" ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 python3 bench/hint_diagnostic_programs.py --model "$out/seed$s/sft/export" \
      --seed "$s" --tasks 48 --out "$out/diagnostic_seed$s.json" > "$out/diagnostic_seed$s.log" 2>&1 &
  fi
done
wait
# 3. the arms (EXTRA_ARMS: other trainers from the same SFT, e.g. "ppo1 lora_r16", run beside them)
"${ablation[@]}" --seeds $seeds --arms grpo hybrid_lam0.1 hybrid_lam0.3 placebo ${EXTRA_ARMS:-} $(deadline) \
  | tee "$out/ablation.log"
# 4. the policy as judge (its own OUT: the ablation's table stays the four arms'); PROBE=0 skips it
[ "${PROBE:-1}" = 1 ] || exit 0
first=${seeds%% *}
mkdir -p "$out/probe/seed$first"
[ -e "$out/probe/seed$first/sft" ] || ln -s "$out/seed$first/sft" "$out/probe/seed$first/sft"
python3 bench/hybrid_ablation.py --config configs/smollm2_hybrid.py --out "$out/probe" --jobs 1 --seeds "$first" \
  --arms policy_judge --steps 2 --eval-tasks 4 --set eval.samples_per_task=1 --set "model.path=$gguf" \
  --set "rollout.compilation_cache_dir=$out/xla_cache" \
  $(deadline) > "$out/probe.log" 2>&1 || echo "the policy-judge probe failed: $out/probe.log"
