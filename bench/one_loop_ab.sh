#!/usr/bin/env bash
# Side by side, interleaved: two ganymede binaries (A: before a change, B: after), each config
# run A then B, round-robin. Usage: A=old/ganymede B=new/ganymede [REPS=3] bench/one_loop_ab.sh
# (build A from the older commit in a git worktree: `cargo build --release -p ganymede`).
set -euo pipefail
A=${A:?set A to the binary before the change}
B=${B:?set B to the binary after the change}
reps=${REPS:-3}
EXTRA=${EXTRA:-}  # more --set flags for both sides (e.g. to pin a default that changed)
# CONFIGS: "preset optimizer steps" triples separated by commas (default: the four below).
CONFIGS=${CONFIGS:-"tiny muon 60,tiny adamw 60,small muon 12,small adamw 12"}
out=/tmp/seam_ab; rm -rf $out; mkdir -p $out
for rep in $(seq 1 $reps); do
  IFS=, read -ra cfgs <<<"$CONFIGS"
  for cfg in "${cfgs[@]}"; do
    set -- $cfg
    for side in A B; do
      bin=${!side}
      d=$out/$1-$2-$side-$rep
      $bin train --preset $1 --steps $3 --set optimizer.name=$2 --set training.threads=2 --set checkpoint.enable=false --set metrics.val_every=0 $EXTRA --out $d > $d.log 2>&1
      python3 - "$d/metrics.jsonl" "$1 $2 $side $rep" <<'PY'
import json,sys
m=[json.loads(l) for l in open(sys.argv[1])]
# steps after the first (warm-up) only
tps=[x["tokens_per_s"] for x in m[1:]]
tps.sort()
print(sys.argv[2], "median_tok_s", round(tps[len(tps)//2]), "last_loss", m[-1]["loss"])
PY
    done
  done
done
