#!/usr/bin/env bash
# Optimizer state on the device (A: optimizer.offload=false) against in host memory (B: true),
# both in the two-memory CPU mode (checking off), one binary, interleaved round-robin per config.
# Usage: [BIN=target/release/ganymede] [REPS=3] bench/optim_offload_ab.sh
set -euo pipefail
bin=${BIN:-target/release/ganymede}
reps=${REPS:-3}
out=/tmp/optoff_ab; rm -rf $out; mkdir -p $out
for rep in $(seq 1 $reps); do
  for cfg in "tiny muon 60" "tiny adamw 60" "small muon 10" "small adamw 10"; do
    set -- $cfg
    for offload in false true; do
      d=$out/$1-$2-$offload-$rep
      $bin train --preset $1 --steps $3 --set optimizer.name=$2 --set optimizer.offload=$offload \
        --set 'device.kind="cpu-two-memory"' --set training.threads=2 --set checkpoint.enable=false \
        --set metrics.val_every=0 --out $d > $d.log 2>&1
      python3 - "$d/metrics.jsonl" "$1 $2 offload=$offload $rep" <<'PY'
import json,sys
m=[json.loads(l) for l in open(sys.argv[1])]
# steps after the first (warm-up) only
tps=sorted(x["tokens_per_s"] for x in m[1:])
print(sys.argv[2], "median_tok_s", round(tps[len(tps)//2]), "last_loss", m[-1]["loss"])
PY
    done
  done
done
