#!/usr/bin/env bash
# configs/smollm2_tools.py measured on one GPU in one command: for each seed, the base model's held-out
# evaluation and the full run (SFT, then GRPO), all processes at once; then the table (base / SFT / RL, per
# split), the learning curves, what the recipe cost the model's chat (bench/chat_drift.py), and the raw decode
# of the same model at the rollout's concurrency (bench/decode.py).
#   bash bench/smollm2_tools.sh OUT_DIR GGUF_FILE [SEED ...]          (default seeds: 0 1 2)
# GGUF_FILE: SmolLM2-135M-Instruct.Q4_1.gguf (python -m agentrl_jax.assets smollm2 DIR fetches it).
# Each process gets 0.9 / (processes started) of the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless
# set); at 0.15 of an 80 GB card (six processes) a training process ran out of memory in its update.
set -euo pipefail
out=${1:?usage: bench/smollm2_tools.sh OUT_DIR GGUF_FILE [SEED ...]}
gguf=${2:?usage: bench/smollm2_tools.sh OUT_DIR GGUF_FILE [SEED ...]}
shift 2
seeds=${*:-0 1 2}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, for the python3 -c and bench scripts below
n=0  # the processes this call starts: a finished run (its results.json) is kept, not run again
for s in $seeds; do
  [ -f "$out/base/seed$s/results.json" ] || n=$((n + 1))
  [ -f "$out/seed$s/results.json" ] || n=$((n + 1))
done
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(python3 -c "print(round(0.9 / max($n, 1), 3))")}
mkdir -p "$out/base"
# Converted once here, so the processes below find it in the cache instead of converting it side by side.
hf=$(python3 -c "import sys; from agentrl_jax.models.gguf_cache import hf_directory; print(hf_directory(sys.argv[1]))" "$gguf")
run="python3 $here/../launch/tpu_pod.py --config $here/../configs/smollm2_tools.py --set model.path=$gguf"
for s in $seeds; do  # run the command again to finish what a killed call left
  [ -f "$out/base/seed$s/results.json" ] || $run --set seed=$s --set sft.steps=0 --set total_steps=0 \
    --set checkpoint.export_hf=false --set output_dir="$out/base/seed$s" > "$out/base/seed$s.log" 2>&1 &
  [ -f "$out/seed$s/results.json" ] || $run --set seed=$s --set output_dir="$out/seed$s" > "$out/seed$s.log" 2>&1 &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
python3 "$here/seeds_summary.py" "$out" $seeds --base "$out/base" --plots "$out/plots" | tee "$out/summary.md"
exports=$(for s in $seeds; do [ -d "$out/seed$s/export" ] && echo "$out/seed$s/export"; done || true)
if [ -n "$exports" ] && [ ! -f "$out/chat_drift.json" ]; then
  python3 "$here/chat_drift.py" --base "$hf" --trained $exports --out "$out/chat_drift.json" \
    --markdown "$out/chat_drift.md" > "$out/chat_drift.log" 2>&1 || status=1
fi
python3 "$here/decode.py" --sizes smollm2 --batches 128 --prompt 128 --gen 256 --steps-per-dispatch 16 --no-hf \
  --json "$out/decode.json" 2>&1 | tee "$out/decode.log" || status=1
exit $status
