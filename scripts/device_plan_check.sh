#!/usr/bin/env bash
# The planner against the device (issue 37), about 3 minutes on an H200: calibrate the GPU
# through the backend seam (`ganymede calibrate --device cuda`, a [gpu_measured] section on
# dgx-h200), plan `medium` and the `europa-1t` slice with that cluster file, train a few steps
# of each, and write OUTDIR/plan.md: predicted against measured step time and peak memory by
# category (the run's memory.json), one table.
# Usage: scripts/device_plan_check.sh OUTDIR  (GANYMEDE_BIN, GANYMEDE_PYTHON as device_check.sh;
# GANYMEDE_DEVICE=cpu-two-memory and GANYMEDE_PLAN_PRESETS="tiny small" try it without a GPU)
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${GANYMEDE_BIN:-$root/target/dist/ganymede}
py=${GANYMEDE_PYTHON:-python3}
kind=${GANYMEDE_DEVICE:-cuda}
presets=${GANYMEDE_PLAN_PRESETS:-medium europa-1t-slice}
steps=${GANYMEDE_PLAN_STEPS:-6}
md=$out/plan.md
runs=$out/plan-runs
mkdir -p "$runs"
cluster=$out/gpu-measured.toml
echo "# The planner against $kind" >"$md"
echo >>"$md"
timeout 120 "$bin" calibrate --device "$kind" --out "$cluster" --force >"$out/calibrate.log" 2>&1
crc=$?
echo "- calibrate --device $kind: exit $crc; $cluster" >>"$md"
echo '```' >>"$md"; tail -12 "$out/calibrate.log" >>"$md"; echo '```' >>"$md"
[ $crc -eq 0 ] || cluster=dgx-h200
for p in $presets; do
    timeout 30 "$bin" plan --preset "$p" --cluster "$cluster" --nodes 1 --gpus-per-node 1 \
        --set "device.kind=$kind" --json >"$runs/$p.plan.json" 2>"$runs/$p.plan.log"
    timeout 30 "$bin" plan --preset "$p" --cluster "$cluster" --nodes 1 --gpus-per-node 1 \
        --set "device.kind=$kind" >"$runs/$p.plan.txt" 2>&1
    timeout 150 "$bin" train --preset "$p" --out "$runs/$p" --steps "$steps" \
        --set "device.kind=$kind" --set metrics.val_every=0 >"$runs/$p.train.log" 2>&1
    echo "- $p: train exit $?" >>"$md"
done
"$py" - "$runs" "$presets" >>"$md" <<'PYEOF'
import json, sys, os, statistics
runs, presets = sys.argv[1], sys.argv[2].split()
mib = 2**20
print("\n| preset | quantity | predicted | measured | error |\n|---|---|---|---|---|")
def row(p, q, pred, meas, unit):
    err = f"{(pred / meas - 1) * 100:+.1f}%" if pred and meas else "-"
    f = (lambda v: f"{v / mib:,.1f} MiB") if unit == "B" else (lambda v: f"{v * 1e3:.1f} ms")
    print(f"| {p} | {q} | {f(pred) if pred is not None else '-'} | {f(meas) if meas is not None else '-'} | {err} |")
for p in presets:
    try:
        plan = json.load(open(f"{runs}/{p}.plan.json"))
    except (OSError, ValueError):
        print(f"| {p} | plan | failed | - | - |"); continue
    t = plan["time"]
    steps = []
    try:
        for line in open(f"{runs}/{p}/metrics.jsonl"):
            r = json.loads(line)
            if "step_s" in r:
                steps.append(r["step_s"])
    except OSError:
        pass
    # The first steps warm up (allocation, kernel compilation): the median of the rest.
    meas = statistics.median(steps[2:] or steps) if steps else None
    row(p, "step time", plan["step_time_s"], meas, "s")
    for q in ("forward_s", "backward_s", "optimizer_s", "d2h_s", "h2d_s"):
        print(f"| {p} | {q} (predicted only) | {t[q]*1e3:.1f} ms | - | - |")
    try:
        mem = json.load(open(f"{runs}/{p}/memory.json"))
    except (OSError, ValueError):
        mem = {}
    # The cluster planner's peak against the device ledger's (the runtime reserve is the
    # planner's alone); then each cluster-planner category, and the ledger's categories against
    # the runtime's own prediction (crates/plan/src/fit.rs).
    peaks = [d["peak_total_bytes"] for d in mem.values() if isinstance(d, dict) and "peak_total_bytes" in d]
    reserve = plan["memory"]["gpu"].get("reserved", 0)
    row(p, "GPU peak (cluster planner, less reserve)", plan["memory"]["gpu_total"] - reserve, max(peaks) if peaks else None, "B")
    for cat, v in plan["memory"]["gpu"].items():
        if isinstance(v, (int, float)) and v:
            print(f"| {p} | cluster planner {cat} | {v / mib:,.1f} MiB | | |")
    for dev, d in mem.items():
        if isinstance(d, dict) and "peak_bytes" in d:
            for cat, v in d["peak_bytes"].items():
                pl = d.get("planner_peak_bytes", {}).get(cat)
                row(p, f"{dev} {cat} (ledger)", pl, v, "B")
PYEOF
echo "plan check: see $md"
