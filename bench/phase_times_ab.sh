#!/usr/bin/env bash
# The cost of timing steps by phase (metrics.phase_times) on the CPU backend: one binary, each
# config run with the phase clock on then off, round-robin, REPS times (interleaved, so a
# neighbour's load falls on both sides alike). Prints each run's median step time (steps after
# the first) and, per config, the median over the repetitions of each side and their ratio.
# Usage: [BIN=target/release/ganymede] [REPS=5] bench/phase_times_ab.sh
set -euo pipefail
BIN=${BIN:-target/release/ganymede}
reps=${REPS:-5}
out=/tmp/phase_ab; rm -rf $out; mkdir -p $out
for rep in $(seq 1 $reps); do
  for cfg in "tiny adamw 60" "small adamw 12"; do
    set -- $cfg
    for side in on off; do
      d=$out/$1-$2-$side-$rep
      flag=$([ $side = on ] && echo true || echo false)
      $BIN train --preset $1 --steps $3 --set optimizer.name=$2 --set training.threads=2 \
        --set checkpoint.enable=false --set metrics.val_every=0 \
        --set metrics.phase_times=$flag --out $d > $d.log 2>&1
      python3 - "$d/metrics.jsonl" "$1 $2 $side $rep" <<'PY'
import json,sys
m=[json.loads(l) for l in open(sys.argv[1])][1:]
s=sorted(x["step_s"] for x in m)
print(sys.argv[2], "median_step_ms", round(1e3*s[len(s)//2], 2), "marks", m[-1].get("phase_marks"), "last_loss", m[-1]["loss"])
PY
    done
  done
done | tee $out/runs.txt
python3 - $out/runs.txt <<'PY'
import sys,statistics as st
runs={}
for l in open(sys.argv[1]):
    f=l.split(); runs.setdefault((f[0],f[1]),{}).setdefault(f[2],[]).append(float(f[5]))
for (p,o),s in runs.items():
    on,off=st.median(s["on"]),st.median(s["off"])
    print(f"{p} {o}: phase times on {on:.2f} ms, off {off:.2f} ms per step (medians of {len(s['on'])}); on/off {on/off:.4f}")
PY
