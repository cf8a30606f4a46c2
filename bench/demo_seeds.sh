#!/usr/bin/env bash
# The embedded demo for several seeds at once (one process each), then a table of held-out
# pass@1 / tool-use before (SFT) and after RL, with mean and spread over seeds.
#   bash bench/demo_seeds.sh OUT_DIR [SEED ...]      (default seeds: 0 1 2)
set -euo pipefail
out=${1:?usage: bench/demo_seeds.sh OUT_DIR [SEED ...]}; shift
seeds=${*:-0 1 2}
mkdir -p "$out"
for s in $seeds; do
  python3 launch/tpu_pod.py --config configs/demo.py --set seed=$s --set output_dir="$out/seed$s" \
    > "$out/seed$s.log" 2>&1 &
done
wait
python3 - "$out" $seeds <<'PY'
import json, sys, statistics as st
out, seeds = sys.argv[1], sys.argv[2:]
rows = {s: json.load(open(f"{out}/seed{s}/results.json")) for s in seeds}
print("| seed | SFT pass@1 | RL pass@1 | SFT tool use | RL tool use | SFT pass@4 | RL pass@4 | total s |")
print("|---|---|---|---|---|---|---|---|")
for s, r in rows.items():
    a, b = r["start"], r["end"]
    print(f"| {s} | {a['pass_at_1']:.3f} | {b['pass_at_1']:.3f} | {a['tool_use_rate']:.3f} | {b['tool_use_rate']:.3f} "
          f"| {a['pass_at_4']:.3f} | {b['pass_at_4']:.3f} | {r['total_seconds']:.0f} |")
for stage in ("start", "end"):
    v = [r[stage]["pass_at_1"] for r in rows.values()]
    print(f"{stage}: pass@1 mean {st.mean(v):.3f} sd {st.pstdev(v):.3f} min {min(v):.3f} max {max(v):.3f}")
PY
