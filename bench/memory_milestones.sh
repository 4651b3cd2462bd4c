#!/usr/bin/env bash
# The memory milestones' cost on this CPU (issue 8): tokens/s of every combination of activation
# offload (activation_checkpoint.offload_fraction 0, 0.5, 1) and optimizer offload (off, on), in
# the two-memory CPU mode (checking off), one binary, round-robin so a neighbour's load falls on
# every setting alike. Prints one line per run and a median table; every setting's last loss must
# be the same (the offloads move bytes, not arithmetic).
#
#   bench/memory_milestones.sh                     # tiny at 1 and 4 ranks, small at 1 rank
#   REPS=2 CASES="tiny:1:40" bench/memory_milestones.sh
#
# Env: BIN (target/release/ganymede), REPS (3), CASES ("preset:ranks:steps" list).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/ganymede}
REPS=${REPS:-3}
CASES=${CASES:-tiny:1:40 tiny:4:40 small:1:4}
OUT=$(mktemp -d /tmp/memory_milestones.XXXXXX)
echo "# $(date -u +%FT%TZ)  $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; reps=$REPS" >&2
echo "# load before: $(uptime)" >&2
for rep in $(seq 1 "$REPS"); do
  for case in $CASES; do
    IFS=: read -r preset ranks steps <<<"$case"
    for f in 0 0.5 1; do
      for opt in false true; do
        d=$OUT/$preset-$ranks-$f-$opt-$rep
        "$BIN" train --preset "$preset" --steps "$steps" --ranks "$ranks" --out "$d" \
          --set 'device.kind="cpu-two-memory"' --set training.threads=2 \
          --set checkpoint.enable=false --set metrics.val_every=0 \
          --set activation_checkpoint.offload_fraction="$f" --set optimizer.offload="$opt" \
          >"$d.log" 2>&1
        python3 - "$d" "$preset $ranks $f $opt $rep" <<'PY'
import json, sys
d, label = sys.argv[1], sys.argv[2]
m = [json.loads(l) for l in open(d + "/metrics.jsonl") if '"tokens_per_s"' in l]
tps = sorted(x["tokens_per_s"] for x in m[1:])  # the first step warms up
mem = json.load(open(d + "/memory.json"))
peak = lambda dev: mem.get(dev, {}).get("peak_total_bytes", 0) / 2**20
print(label, round(tps[len(tps) // 2]), repr(m[-1]["loss"]),
      round(peak("gpu0"), 2), round(peak("host"), 2))
PY
      done
    done
  done
done | tee "$OUT/results.txt"
echo "# load after: $(uptime)" >&2
python3 - "$OUT/results.txt" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    p, r, f, o, rep, tps, loss, dev, host = line.split()
    rows.setdefault((p, r, f, o), []).append((int(tps), loss, float(dev), float(host)))
print("| preset | ranks | offload_fraction | optimizer.offload | tokens/s (median) | vs 0/off | device peak MiB | host peak MiB | last loss |")
print("|---|---|---|---|---|---|---|---|---|")
for (p, r, f, o), v in rows.items():
    base = statistics.median(x[0] for x in rows[(p, r, "0", "false")])
    med = statistics.median(x[0] for x in v)
    losses = {x[1] for x in v}
    print(f"| {p} | {r} | {f} | {o} | {med:,.0f} | {med / base:.2f} | {v[0][2]:.2f} | {v[0][3]:.2f} | {' '.join(sorted(losses))} |")
PY
