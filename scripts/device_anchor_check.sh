#!/usr/bin/env bash
# The anchors of issue 32, side by side on one GPU (called by scripts/device_check.sh; runnable
# alone): ganymede's `large` with AdamW and with Muon, TorchTitan's own Qwen3 MoE model
# (bench/torchtitan_qwen3moe.py) at `large` and `medium` with AdamW and Muon (torch.compile
# where time is left), torch SDPA's attention ceiling (bench/sdpa_ceiling.py) beside the device
# check's own attention table, and the verdict lines. transformers' Qwen3-MoE is the second
# PyTorch row: scripts/device_train_check.sh runs it at `medium` (its tokens/s are read from
# OUTDIR/runs/torch-*.tps, with ganymede's medium runs, where that check ran first), and this
# script at the preset last, where time is left.
# Writes OUTDIR/anchors.md. Every run has its own limit, cut to the deadline, so a slow piece
# leaves the rest and a line saying what happened.
# Usage: scripts/device_anchor_check.sh OUTDIR
#   GANYMEDE_BIN (default target/dist/ganymede), GANYMEDE_PYTHON (torch's Python),
#   GANYMEDE_ANCHOR_DEADLINE (seconds since the epoch; default now + 300),
#   GANYMEDE_CHECK_KIND (default cuda; cpu with GANYMEDE_ANCHOR_PRESET=tiny dry-runs the script
#   without a GPU), GANYMEDE_ANCHOR_PRESET (default large), GANYMEDE_ANCHOR_LAYERS (default the
#   preset's, 8 for `large` on a GPU under 100 GiB: an 80 GB H100 cannot hold its 12 layers with
#   AdamW), GANYMEDE_ANCHOR_STEPS (ganymede's optimizer steps, default 4: steps 3 and 4 timed),
#   GANYMEDE_ANCHOR_TORCH_STEPS (TorchTitan's timed steps, default 2),
#   GANYMEDE_ANCHOR_TORCH_WARMUP (its untimed steps first, default 1),
#   GANYMEDE_ANCHOR_ACCUM (microbatches an optimizer step, both frameworks; default the
#   preset's, `large` 16 of 2 sequences),
#   GANYMEDE_ANCHOR_MEDIUM (1: TorchTitan at medium too, the default), GANYMEDE_PEAK_TFLOPS
#   (default 989), GANYMEDE_WHEELHOUSE (default bench/wheelhouse).
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${GANYMEDE_BIN:-$root/target/dist/ganymede}
py=${GANYMEDE_PYTHON:-python3}
kind=${GANYMEDE_CHECK_KIND:-cuda}
preset=${GANYMEDE_ANCHOR_PRESET:-large}
steps=${GANYMEDE_ANCHOR_STEPS:-4}
tsteps=${GANYMEDE_ANCHOR_TORCH_STEPS:-2}
twarm=${GANYMEDE_ANCHOR_TORCH_WARMUP:-1}
with_medium=${GANYMEDE_ANCHOR_MEDIUM:-1}
peak=${GANYMEDE_PEAK_TFLOPS:-989}
wheelhouse=${GANYMEDE_WHEELHOUSE:-$root/bench/wheelhouse}
deadline=${GANYMEDE_ANCHOR_DEADLINE:-$(($(date +%s) + 300))}
md=$out/anchors.md
runs=$out/anchor-runs
mkdir -p "$runs"
# The tables read every JSON line here: none may be left from an earlier run.
rm -f "$runs"/*.json "$runs/sdpa.md"
tdev=cpu
[ "$kind" = cuda ] && tdev=cuda

# The limit a run gets: what it wants, cut to end 10 s before the deadline (the closing
# tables' time); 0 (skip) where under 15 s would be left.
fit() {
    local want=$1 left
    left=$((deadline - $(date +%s) - 10))
    [ "$left" -lt "$want" ] && want=$left
    if [ "$want" -ge 15 ]; then echo "$want"; else echo 0; fi
}
skipped() { echo "- \`$1\`: skipped, $((deadline - $(date +%s))) s left before the deadline" >>"$md"; }

layers=${GANYMEDE_ANCHOR_LAYERS:-}
gpu_mib=$(timeout 20 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc 0-9)
if [ -z "$layers" ] && [ "$preset" = large ] && [ -n "$gpu_mib" ] && [ "$gpu_mib" -lt 102400 ]; then
    layers=8
fi
{
    echo "# Anchors: ganymede against TorchTitan and transformers, one GPU ($kind)"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M:%S UTC'); binary $bin; GPU memory ${gpu_mib:-unknown} MiB;" \
        "preset $preset${layers:+ with $layers layers (every run, both frameworks)}"
    echo
} >"$md"

# TorchTitan's wheels, installed without network into OUTDIR/site (pip, else unzipped: they are
# pure Python).
site=$out/site
rm -rf "$site"
if ls "$wheelhouse"/*.whl >/dev/null 2>&1; then
    how=pip
    if ! timeout 120 "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        "$wheelhouse"/*.whl >"$runs/pip.log" 2>&1; then
        how="unzipped (pip failed: $(tail -1 "$runs/pip.log"))"
        "$py" - "$site" "$wheelhouse"/*.whl >>"$runs/pip.log" 2>&1 <<'EOF'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
print("unzipped", len(sys.argv) - 2, "wheels")
EOF
    fi
    echo "- TorchTitan's wheels: $(ls "$wheelhouse"/*.whl | wc -l) from $wheelhouse into $site by $how" >>"$md"
else
    echo "- no wheels in $wheelhouse (scripts/fetch_wheelhouse.sh, and carry bench/wheelhouse): TorchTitan's rows will fail" >>"$md"
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
# Fewer out-of-memory failures from fragmentation at `large` (PyTorch's own advice).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# Model FLOPs per token from ganymede's planner, for every MFU here (one numerator for all).
set_layers=()
[ -n "$layers" ] && set_layers=(--set "model.layers=$layers")
fpt_of() {
    "$bin" plan --preset "$1" "${@:2}" --json 2>/dev/null | "$py" -c \
        'import json, sys; print(json.load(sys.stdin)["flops"]["model_per_token"])' 2>/dev/null || echo 0
}
fpt=$(fpt_of "$preset" "${set_layers[@]}")
fpt_medium=$(fpt_of medium)
echo "- model FLOPs per token (ganymede plan): $preset $fpt, medium $fpt_medium; peak $peak TFLOP/s" >>"$md"
echo >>"$md"

# 1. The attention ceiling: torch SDPA at the presets' attention shapes.
lim=$(fit 45)
if [ "$lim" = 0 ]; then
    skipped sdpa
else
    sdpa_args=(--device "$tdev")
    [ "$kind" = cuda ] || sdpa_args+=(--tiny)
    timeout "$lim" "$py" "$root/bench/sdpa_ceiling.py" "${sdpa_args[@]}" >"$runs/sdpa.md" 2>"$runs/sdpa.log" ||
        echo "- sdpa_ceiling: exit $? ($(tail -1 "$runs/sdpa.log"))" >>"$md"
fi

# 2. ganymede: NAME LIMIT PRESET ARGS...; a JSON line to $runs/NAME.json (median tokens/s and
#    step time of steps 3 on, or of all where fewer were logged).
gany() {
    local name=$1 limit p=$3
    limit=$(fit "$2")
    shift 3
    [ "$limit" = 0 ] && { skipped "$name"; return; }
    timeout "$limit" "$bin" train --preset "$p" --out "$runs/$name" --set "device.kind=$kind" \
        --set metrics.val_every=0 --set checkpoint.enable=false "$@" >"$runs/$name.log" 2>&1
    local rc=$?
    [ $rc = 0 ] || echo "- \`$name\`: exit $rc$([ $rc = 124 ] && echo ' (timed out)'): \`$(tail -1 "$runs/$name.log")\`" >>"$md"
    "$py" - "$runs/$name/metrics.jsonl" "$runs/$name/memory.json" "$name" "$*" >"$runs/$name.json" <<'EOF'
import json, statistics, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_s"' in l]
except OSError:
    rows = []
if not rows:
    sys.exit(0)
use = rows[2:] or rows
peak = None
try:
    peak = max(d["peak_total_bytes"] for d in json.load(open(sys.argv[2])).values()
               if isinstance(d, dict) and "peak_total_bytes" in d) / 2**30
except (OSError, ValueError):
    pass
print(json.dumps({"name": sys.argv[3], "args": sys.argv[4], "steps": len(rows),
                  "tokens_per_s": statistics.median(r["tokens_per_s"] for r in use),
                  "median_step_s": statistics.median(r["step_s"] for r in use),
                  "peak_memory_gib": peak}))
EOF
}
# 3. TorchTitan: NAME LIMIT PRESET FLOPS ARGS...; its JSON line to $runs/NAME.json.
titan() {
    local name=$1 limit p=$3 f=$4
    limit=$(fit "$2")
    shift 4
    [ "$limit" = 0 ] && { skipped "$name"; return; }
    local extra=()
    [ "$kind" = cuda ] && extra+=(--fused)
    timeout "$limit" "$py" "$root/bench/torchtitan_qwen3moe.py" --preset "$p" --device "$tdev" \
        --steps "$tsteps" --warmup "$twarm" --flops-per-token "$f" --peak-tflops "$peak" "${extra[@]}" "$@" \
        >"$runs/$name.json" 2>"$runs/$name.log"
    local rc=$?
    [ $rc = 0 ] || echo "- \`$name\`: exit $rc$([ $rc = 124 ] && echo ' (timed out)'): \`$(tail -1 "$runs/$name.log")\`" >>"$md"
}
tl=()
[ -n "$layers" ] && tl=(--layers "$layers")
if [ -n "${GANYMEDE_ANCHOR_ACCUM:-}" ]; then
    # The preset's microbatch (ganymede's training.micro_batch_size, the anchor's table) times
    # the accumulation is the step's batch on both sides.
    mb=$("$bin" plan --preset "$preset" --json 2>/dev/null | "$py" -c \
        'import json, sys; print(json.load(sys.stdin)["layout"]["micro_batch"])' 2>/dev/null || echo 1)
    set_layers+=(--set "training.batch_size=$((GANYMEDE_ANCHOR_ACCUM * mb))" --set "training.micro_batch_size=$mb")
    tl+=(--accum "$GANYMEDE_ANCHOR_ACCUM")
    echo "- accumulation $GANYMEDE_ANCHOR_ACCUM microbatches of $mb sequences a step (GANYMEDE_ANCHOR_ACCUM), both frameworks" >>"$md"
fi
gany "ganymede-$preset-adamw" 100 "$preset" --steps "$steps" --set optimizer.name=adamw "${set_layers[@]}"
titan "torchtitan-$preset-adamw" 100 "$preset" "$fpt" "${tl[@]}"
gany "ganymede-$preset-muon" 100 "$preset" --steps "$steps" --set optimizer.name=muon "${set_layers[@]}"
titan "torchtitan-$preset-muon" 100 "$preset" "$fpt" --optimizer muon "${tl[@]}"
if [ "$with_medium" = 1 ] && [ "$preset" != medium ] && [ "$kind" = cuda ]; then
    titan torchtitan-medium-adamw 60 medium "$fpt_medium"
    titan torchtitan-medium-muon 60 medium "$fpt_medium" --optimizer muon
fi
# torch.compile last: the slowest to start.
titan "torchtitan-$preset-adamw-compile" 150 "$preset" "$fpt" --compile "${tl[@]}"
# transformers' Qwen3-MoE at the preset, where time is left (it runs at medium in the training
# check): autocast bf16, grouped_mm experts, SDPA, fused AdamW, the same accumulation.
name=transformers-$preset-adamw
lim=$(fit 100)
if [ "$lim" = 0 ]; then
    skipped "$name"
else
    hf=(--steps "$tsteps" --warmup "$twarm" --flops-per-token "$fpt" --peak-tflops "$peak" "${tl[@]}")
    [ "$kind" = cuda ] && hf+=(--device cuda --precision autocast-bf16 --experts grouped_mm --fused)
    timeout "$lim" "$py" "$root/bench/pytorch_qwen3moe.py" --preset "$preset" "${hf[@]}" \
        >"$runs/$name.json" 2>"$runs/$name.log" ||
        echo "- \`$name\`: exit $? (\`$(tail -1 "$runs/$name.log")\`)" >>"$md"
fi

# 4. The tables and the verdicts.
"$py" - "$runs" "$out/runs" "$out/report.md" "$preset" "$fpt" "$fpt_medium" "$peak" >>"$md" <<'EOF'
import glob, json, os, re, sys
runs, train_runs, report, preset, fpt, fpt_m, peak = sys.argv[1:8]
fpt, fpt_m, peak = float(fpt), float(fpt_m), float(peak)
def load(p):
    try:
        return json.loads(open(p).read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
def tps_file(p):
    try:
        return float(open(p).read())
    except (OSError, ValueError):
        return None
rows = {}
for p in sorted(glob.glob(os.path.join(runs, "*.json"))):
    r = load(p)
    if r and r.get("tokens_per_s"):
        rows[os.path.basename(p)[:-5]] = r
# ganymede's and transformers' medium runs from the training check, where it ran.
med = {"ganymede-medium-adamw": "medium-adamw", "ganymede-medium-muon": "medium-muon",
       "transformers-medium-adamw": "torch-eager", "transformers-medium-adamw-compile": "torch-compile"}
for name, f in med.items():
    t = tps_file(os.path.join(train_runs, f + ".tps"))
    if t:
        rows[name] = {"tokens_per_s": t, "median_step_s": 4 * 4096 / t, "from": "train.md"}
def flops(name):
    return fpt_m if "-medium-" in name else fpt
print("\n## Throughput (median of the timed steps; MFU over", f"{peak:g} TFLOP/s)\n")
print("| run | preset | optimizer | tokens/s | MFU | step s | peak GiB | notes |")
print("|---|---|---|---|---|---|---|---|")
for name in sorted(rows, key=lambda n: ("-medium-" not in n, n)):
    r = rows[name]
    fw, p, opt = name.split("-")[0], name.split("-")[1], name.split("-")[2]
    notes = []
    if r.get("compile") or name.endswith("-compile"):
        notes.append("torch.compile")
    if r.get("framework"):
        notes.append(r["framework"])
    if r.get("from"):
        notes.append("from " + r["from"])
    if r.get("shims"):
        notes.append("shim: " + ", ".join(r["shims"]))
    if r.get("accum"):
        notes.append(f"{r['accum']} x {r['micro_batch']} sequences a step")
    if r.get("steps") is not None:
        notes.append(f"{r['steps']} steps logged, median of steps 3.." if r["steps"] >= 3
                     else f"only {r['steps']} steps logged, warm-up included")
    if r.get("step_s") and isinstance(r["step_s"], list):
        notes.append(f"{len(r['step_s'])} timed steps")
    if r.get("args"):
        notes.append(f"`{r['args']}`")
    pk = r.get("peak_memory_gib")
    print(f"| {name} | {p} | {opt} | {r['tokens_per_s']:,.0f} | "
          f"{r['tokens_per_s'] * flops(name) / (peak * 1e12) * 100:.1f}% | "
          f"{r['median_step_s']:.3f} | {'-' if pk is None else f'{pk:.1f}'} | {'; '.join(notes)} |")
print("\n## Verdicts\n")
for p in dict.fromkeys([preset, "medium"]):
    for opt in ("adamw", "muon"):
        g = rows.get(f"ganymede-{p}-{opt}")
        torch = {n: r for n, r in rows.items() if not n.startswith("ganymede")
                 and f"-{p}-{opt}" in n}
        if g and torch:
            target = (" (issue 32: at least 2x)" if p == "medium" else " (issue 32: ahead)")
            for who, pick in (("TorchTitan's best", lambda n: n.startswith("torchtitan")),
                              ("PyTorch's best", lambda n: True)):
                cands = [n for n in torch if pick(n)]
                if not cands:
                    print(f"- {p}, {opt}: no {who} row")
                    continue
                best = max(cands, key=lambda n: torch[n]["tokens_per_s"])
                r = g["tokens_per_s"] / torch[best]["tokens_per_s"]
                print(f"- **{p}, {opt}: ganymede / {who} ({best}) = {r:.2f}x**"
                      f"{target if who.startswith('TorchTitan') else ''}")
        else:
            print(f"- {p}, {opt}: no ratio (ganymede {'ran' if g else 'missing'}, "
                  f"PyTorch {', '.join(torch) or 'none'})")
    ga, gm = rows.get(f"ganymede-{p}-adamw"), rows.get(f"ganymede-{p}-muon")
    if ga and gm:
        r = gm["median_step_s"] / ga["median_step_s"]
        print(f"- **{p}: ganymede's Muon step / AdamW step = {r:.2f}x** (target at most 1.4x: "
              f"{'met' if r <= 1.4 else 'not met'})")
    g = rows.get(f"ganymede-{p}-adamw")
    if g:
        mfu = g["tokens_per_s"] * flops(f"x-{p}-") / (peak * 1e12) * 100
        goal = {"medium": 35, "large": 45}.get(p)
        if goal:
            print(f"- {p} AdamW MFU {mfu:.1f}% (issue 32: {goal}% or more)")
print("\n## Attention: torch SDPA against the device check's kernels\n")
try:
    print(open(os.path.join(runs, "sdpa.md")).read())
except OSError:
    print("(no SDPA table)")
try:
    text = open(report).read()
    m = re.search(r"^## (PASS|FAIL): (Attention[^\n]*)\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    print(f"\nThe device check's section \"{m.group(2)}\" ({m.group(1)}; report.md):\n")
    print(m.group(3).strip())
except (OSError, AttributeError):
    print("\n(no attention section in report.md)")
EOF
echo "anchor check: see $md"
