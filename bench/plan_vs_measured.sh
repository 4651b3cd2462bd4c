#!/usr/bin/env bash
# Planner against measurement (issue 11): calibrate, then train tiny/small x 1/4 ranks x
# AdamW/Muon and print measured (median step time over steps 2.., as `ganymede report` takes it)
# against `ganymede plan --cluster CAL`. Usage: bench/plan_vs_measured.sh OUTDIR [CASES...]
# A case is preset:ranks:optimizer:steps, e.g. small:4:muon:6.
set -euo pipefail
OUT=${1:?outdir}; shift
BIN=${BIN:-target/release/ganymede}
CASES=${*:-"tiny:1:adamw:30 tiny:1:muon:30 tiny:4:adamw:20 tiny:4:muon:20 small:1:adamw:8 small:1:muon:6 small:4:adamw:8 small:4:muon:6"}
mkdir -p "$OUT"
median() { python3 -c '
import json,sys
ls=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ts=[];prev=0.0
for l in ls:
    if "step" not in l: continue
    t=l.get("step_s")
    seen=l.get("tokens_seen")
    if t is None and l.get("tokens_per_s") and seen is not None and seen-prev>0: t=(seen-prev)/l["tokens_per_s"]
    if seen is not None: prev=seen
    if t is not None: ts.append(t)
ts=ts[1:] if len(ts)>1 else ts
ts.sort();n=len(ts)
print(ts[n//2] if n%2 else (ts[n//2-1]+ts[n//2])/2)' "$1"; }
echo "$(date -u '+%F %H:%M:%S UTC') $(git rev-parse --short HEAD) $(lscpu | sed -n 's/^Model name: *//p')"
echo "| preset | optimizer | ranks | steps | load before/after (1 min) | measured (median) | planner: geometric mean (calibrated before / after) | measured/planner |"
echo "|---|---|---|---|---|---|---|---|"
for c in $CASES; do
  IFS=: read -r P R O N <<<"$c"
  D="$OUT/$P-$R-$O"
  rm -rf "$D"
  L0=$(cut -d' ' -f1 /proc/loadavg)
  RA=(); [[ $R != 1 ]] && RA=(--ranks "$R")
  # Calibrate right before each run, under the same load (NO_CAL=1: the `local` preset).
  CAL="$D.cluster.toml"; rm -f "$CAL"
  [[ -z "${NO_CAL:-}" ]] && "$BIN" calibrate --out "$CAL" >"$D.calibrate.log"
  "$BIN" train --preset "$P" --steps "$N" "${RA[@]}" --set optimizer.name="$O" --set metrics.val_every=0 --out "$D" >"$D.log" 2>&1
  L1=$(cut -d' ' -f1 /proc/loadavg)
  # And right after: a 4 s calibration samples the load once, the run lasts longer; the
  # prediction is the geometric mean of the two (both shown).
  CAL2="$D.after.cluster.toml"; rm -f "$CAL2"
  [[ -z "${NO_CAL:-}" ]] && "$BIN" calibrate --out "$CAL2" >"$D.after.calibrate.log"
  M=$(median "$D/metrics.jsonl")
  pred() {
    local CL=(); [[ -f $1 ]] && CL=(--cluster "$1")
    "$BIN" plan --preset "$P" --optimizer "$O" --dp-shard "$R" "${CL[@]}" --json | python3 -c 'import json,sys;print(json.load(sys.stdin)["step_time_s"])'
  }
  PA=$(pred "$CAL"); PB=$(pred "$CAL2")
  python3 -c "m,a,b=float('$M'),float('$PA'),float('$PB');p=(a*b)**0.5;print(f'| $P | $O | $R | $N | $L0/$L1 | {m:.4f} s | {p:.4f} s ({a:.4f} / {b:.4f}) | {m/p:.2f} |')"
done
