#!/usr/bin/env bash
# The training half of the device check (called by scripts/device_check.sh; runnable alone):
#   1. tiny and small, 50 steps on the device against the CPU: per-step losses, tolerance stated
#      (tiny also in microbatches of one sequence, gradient accumulation);
#   2. activation offload and optimizer offload on the device: measured peaks against the planner;
#   3. speed: tokens/s and MFU of `medium` on the device, then PyTorch on the same GPU with the
#      same shapes (transformers' Qwen3-MoE, bf16 autocast, grouped_mm experts, SDPA, fused
#      AdamW; torch.compile if time allows).
# Writes OUTDIR/train.md. Every run has its own timeout, so a slow or failing part leaves the
# rest and a line saying what happened.
# Usage: scripts/device_train_check.sh OUTDIR
#   GANYMEDE_BIN (default target/dist/ganymede), GANYMEDE_PYTHON (for PyTorch and the tables),
#   GANYMEDE_CHECK_KIND (default cuda; cpu-two-memory dry-runs the script without a GPU),
#   GANYMEDE_CHECK_STEPS (default 50), GANYMEDE_CHECK_SPEED (0 skips part 3),
#   GANYMEDE_CHECK_PROFILE (0 skips the op profile of part 3), GANYMEDE_CHECK_TORCH (the PyTorch
#   runs of part 3: default "eager compile"; "eager" leaves torch.compile out).
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${GANYMEDE_BIN:-$root/target/dist/ganymede}
kind=${GANYMEDE_CHECK_KIND:-cuda}
steps=${GANYMEDE_CHECK_STEPS:-50}
speed=${GANYMEDE_CHECK_SPEED:-1}
py=${GANYMEDE_PYTHON:-python3}
profile=${GANYMEDE_CHECK_PROFILE:-1}
torch_runs=${GANYMEDE_CHECK_TORCH:-eager compile}
md=$out/train.md
runs=$out/runs
# A run refuses a directory that holds another's metrics, and the comparisons would then read
# the old ones: an earlier check's runs are refused here instead.
if [ -n "$(ls -A "$runs" 2>/dev/null)" ]; then
    echo "$0: $runs holds an earlier check's runs: pick an empty OUTDIR" >&2
    exit 2
fi
mkdir -p "$runs"

# GANYMEDE_CHECK_DEADLINE (seconds since the epoch, set by scripts/device_check.sh): every run's
# limit is cut to end 10 s before it (the closing tables' time), and a run that would get under
# 15 s is skipped, so the script ends by itself and writes its verdict. 0: no deadline.
deadline=${GANYMEDE_CHECK_DEADLINE:-0}
fit() {
    local want=$1 left
    [ "$deadline" -gt 0 ] || { echo "$want"; return; }
    left=$((deadline - $(date +%s) - 10))
    [ "$left" -lt "$want" ] && want=$left
    if [ "$want" -ge 15 ]; then echo "$want"; else echo 0; fi
}

# One training run: NAME TIMEOUT ARGS...; its log beside its run directory. Exit 125: skipped
# for want of time.
train() {
    local name=$1 limit
    limit=$(fit "$2")
    shift 2
    if [ "$limit" = 0 ]; then
        echo "- \`$name\`: skipped, $((deadline - $(date +%s))) s left before the check's deadline" >>"$md"
        return 125
    fi
    timeout "$limit" "$bin" train --out "$runs/$name" --set metrics.val_every=0 \
        --set checkpoint.enable=false "$@" >"$runs/$name.log" 2>&1
    local rc=$?
    [ $rc = 0 ] || echo "- \`$name\`: exit $rc$([ $rc = 124 ] && echo ' (timed out)'): \`$(tail -1 "$runs/$name.log")\`" >>"$md"
    return $rc
}

{
    echo "# Training on the device ($kind)"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M:%S UTC'); binary $bin"
    echo
} >"$md"

# 1. Losses against the CPU, the same arithmetic on both: Newton–Schulz in f32 on both
#    (optimizer.ns_dtype's default, auto, is bf16 products on a GPU and f32 on the CPU, which
#    put the first H200 run 3.4e-7 apart at step 2 and 9.3e-3 by step 40). Reductions add in
#    other orders, and routing turns rounding into other top-k choices, so the runs drift apart
#    over the steps. f32 (CUDA kernels and cuBLAS SGEMM against the CPU backend): 1e-3 at every
#    step (H200, 2026-12-04: tiny 9.9e-8, small 4.5e-4, tiny in microbatches 1.2e-7). `tiny` with
#    training.compute_dtype = "bf16" (bf16 GEMM operands, tensor-core attention that also rounds
#    P and dS): an operand one ulp apart rounds to a neighbouring bf16, and that grows faster.
#    The CPU against itself with only the MoE chunks changed (a reordering of sums) ends 8.2e-3
#    apart by 50 steps, the H200 1.5e-2 (its first 10 steps within 4.2e-5). So bf16 is held to
#    1e-4 over its first 10 steps and 3e-2 over all.
echo "## $steps steps against the CPU" >>"$md"
echo >>"$md"
# The CPU runs go in the background, 4 threads each, while the device runs take turns: the
# device's time is what is scarce.
parity="tiny:f32:1e-3 small:f32:1e-3 tiny:bf16:3e-2:10:1e-4"
# The router likewise (training.router_dtype's auto is bf16 operands on a GPU under bf16
# compute, f32 on the CPU): pinned to f32 on both, as the earlier runs' tolerances were set.
same=(--set optimizer.ns_dtype=f32 --set training.router_dtype=f32)
cpu_jobs=()
for run in $parity; do
    IFS=: read -r preset dtype _ <<<"$run"
    train "$preset-$dtype-cpu" 150 --preset "$preset" --steps "$steps" --set device.kind=cpu \
        --set "training.compute_dtype=$dtype" --set training.threads=4 "${same[@]}" &
    cpu_jobs+=($!)
done
# Gradient accumulation: tiny's batch of 8 as 8 microbatches of one sequence, on both. Against
# the CPU's own microbatches, not its whole batch: each microbatch has its own auxiliary loss,
# which is not linear in the batch (on the CPU, 50 steps of tiny at one sequence per microbatch
# end 1.6e-2 from the whole batch's losses; 1.4e-7 with model.aux_loss_coef = 0).
train tiny-f32-micro1-cpu 150 --preset tiny --steps "$steps" --set device.kind=cpu \
    --set training.compute_dtype=f32 --set training.micro_batch_size=1 --set training.threads=4 \
    "${same[@]}" &
cpu_jobs+=($!)
for run in $parity; do
    IFS=: read -r preset dtype _ <<<"$run"
    train "$preset-$dtype-dev" 150 --preset "$preset" --steps "$steps" --set "device.kind=$kind" \
        --set "training.compute_dtype=$dtype" "${same[@]}"
done
train tiny-f32-micro1-dev 150 --preset tiny --steps "$steps" --set "device.kind=$kind" \
    --set training.compute_dtype=f32 --set training.micro_batch_size=1 "${same[@]}"
wait "${cpu_jobs[@]}"
# LABEL CPU-RUN DEVICE-RUN TOLERANCE [STEPS TOLERANCE]: one line comparing the runs' per-step
# losses; the optional pair holds the first STEPS steps to a tighter tolerance.
compare() {
    "$py" - "$runs/$2/metrics.jsonl" "$runs/$3/metrics.jsonl" "$1" "$4" "${5:-0}" "${6:-0}" >>"$md" <<'EOF'
import json, math, sys
def losses(p):
    try:
        return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l]
    except OSError:
        return []
a, b, name = losses(sys.argv[1]), losses(sys.argv[2]), sys.argv[3]
tol = float(sys.argv[4])
n = min(len(a), len(b))
# A non-finite loss is written as null: it fails the comparison, named by its step.
finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)
fmt = lambda x: f"{x:.5f}" if finite(x) else str(x)
if n == 0:
    print(f"- {name}: no losses to compare (cpu {len(a)}, device {len(b)} steps)")
else:
    bad = next((i for i in range(n) if not (finite(a[i]) and finite(b[i]))), None)
    # The largest relative difference over the first k steps (a non-finite one is infinite).
    worst = lambda k: max((abs(x - y) / abs(x) if finite(x) and finite(y) and x
                           else float("inf")) for x, y in zip(a[:k], b[:k])) if k else 0.0
    early_n, early_tol = int(sys.argv[5]), float(sys.argv[6])
    rel, early = worst(n), worst(early_n)
    if len(a) != len(b):
        ok = f"INCOMPLETE (cpu {len(a)} / device {len(b)} steps)"
    else:
        ok = "PASS" if rel <= tol and early <= early_tol else "FAIL"
    if early_n:
        tol = f"{tol:g}; first {early_n} steps {early:.2e}, tolerance {early_tol:g}"
    nonfinite = (f"; step {bad + 1} not finite (cpu {fmt(a[bad])}, device {fmt(b[bad])})"
                 if bad is not None else "")
    print(f"- {name}: {n} steps, loss {fmt(a[0])} → cpu {fmt(a[n-1])} / device {fmt(b[n-1])}; "
          f"max relative difference {rel:.2e} (tolerance {tol}){nonfinite}: **{ok}**")
EOF
}
for run in $parity; do
    IFS=: read -r preset dtype tol early_n early_tol <<<"$run"
    compare "$preset-$dtype" "$preset-$dtype-cpu" "$preset-$dtype-dev" "$tol" "${early_n:-0}" "${early_tol:-0}"
done
compare "tiny-f32, 8 microbatches of one sequence" tiny-f32-micro1-cpu tiny-f32-micro1-dev 1e-3
echo >>"$md"

# 2. Offload on the device: measured peaks against the planner's, per memory.
echo "## Offload peaks against the planner" >>"$md"
echo >>"$md"
for what in "activations:--set activation_checkpoint.offload_fraction=1" \
    "optimizer:--set optimizer.offload=true" \
    "both:--set activation_checkpoint.offload_fraction=1 --set optimizer.offload=true"; do
    name=offload-${what%%:*}
    # shellcheck disable=SC2086
    train "$name" 120 --preset tiny --steps 5 --set "device.kind=$kind" --set model.layers=4 ${what#*:}
    "$py" - "$runs/$name/memory.json" "$name" >>"$md" <<'EOF'
import json, sys
try:
    m = json.load(open(sys.argv[1]))
except OSError:
    print(f"- {sys.argv[2]}: no memory.json"); sys.exit()
for dev, d in m.items():
    if not isinstance(d, dict) or "planner_peak_bytes" not in d:
        continue
    meas, pred = d["peak_total_bytes"], d["planner_peak_total_bytes"]
    cats = ", ".join(f"{c} {d['peak_bytes'].get(c, 0)/2**20:.2f}/{p/2**20:.2f}"
                     for c, p in d["planner_peak_bytes"].items())
    print(f"- {sys.argv[2]}, {dev}: peak {meas/2**20:.2f} MiB measured, {pred/2**20:.2f} planner "
          f"({(meas/pred - 1)*100:+.1f}%); MiB measured/planner: {cats}")
EOF
done
echo >>"$md"

[ "$speed" = 1 ] || exit 0

# 3. Speed at medium, ganymede then PyTorch, one after the other on the same GPU, the same
#    shapes, both in bf16 compute over fp32 master weights with every activation kept (the
#    preset's configuration; PyTorch's script checkpoints nothing) and AdamW (PyTorch's fused).
#    ganymede's Muon (its default optimizer) is timed after, for what it adds. MFU with the same
#    model FLOPs per token for both (ganymede plan's, causal attention halved) over the GPU's
#    dense bf16 peak (H200/H100 SXM: 989 TFLOP/s). ganymede clips gradients (training.grad_clip
#    = 1, a norm over every gradient); PyTorch's script does not.
peak=${GANYMEDE_PEAK_TFLOPS:-989}
fpt=$("$bin" plan --preset medium --json 2>/dev/null | "$py" -c \
    'import json, sys; f = json.load(sys.stdin)["flops"]; print(f["model_per_token"])' 2>/dev/null || echo 0)
echo "## Speed at medium (model FLOPs/token $fpt, peak $peak TFLOP/s)" >>"$md"
echo >>"$md"
# A ganymede speed run: NAME TIMEOUT STEPS ARGS...; its median tokens/s (steps 3 on) goes to
# $runs/NAME.tps for the closing ratio.
# A run that fails by itself with fewer than 3 steps logged, or hangs (its time limit with no
# step logged), is run once more on the kernels least likely to be at fault, the SIMT attention
# and one GEMM per expert, so one device session still gives a speed; its line says so, and the
# later medium runs go straight to those kernels. A run that logged 3 steps or more keeps them
# whatever its exit (an error at its end does not void its speed).
fallback_env=(GANYMEDE_CUDA_ATTENTION=simt GANYMEDE_CUDA_GROUPED=loop)
use_fallback=0
steps_logged() {
    local n
    n=$(grep -c '"step_s"' "$runs/$1/metrics.jsonl" 2>/dev/null)
    echo "${n:-0}"
}
speed() {
    local name=$1 limit=$2 steps=$3 run=$1 rc n
    shift 3
    if [ $use_fallback = 0 ] || [ -n "${GANYMEDE_CUDA_ATTENTION:-}" ]; then
        train "$name" "$limit" --preset medium --steps "$steps" --set "device.kind=$kind" "$@"
        rc=$?
        n=$(steps_logged "$name")
        if [ $rc != 0 ] && [ $rc != 125 ] && [ "$n" -ge 3 ]; then
            echo "- \`$name\`: its $n logged steps are timed all the same" >>"$md"
        fi
        if [ $rc != 0 ] && [ $rc != 125 ] && [ -z "${GANYMEDE_CUDA_ATTENTION:-}" ] &&
            { { [ $rc != 124 ] && [ "$n" -lt 3 ]; } || [ "$n" = 0 ]; }; then
            use_fallback=1
        fi
    fi
    if [ $use_fallback = 1 ] && [ -z "${GANYMEDE_CUDA_ATTENTION:-}" ]; then
        run=$name-fallback
        (
            export "${fallback_env[@]}"
            train "$run" "$limit" --preset medium --steps "$steps" --set "device.kind=$kind" "$@"
        )
    fi
    "$py" - "$runs/$run/metrics.jsonl" "$fpt" "$peak" "$run" "$*" "$runs/$name.tps" >>"$md" <<'EOF'
import json, statistics, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_s"' in l]
except OSError:
    rows = []
fpt, peak, name, args = float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
t = [r["tokens_per_s"] for r in rows[2:]] or [r["tokens_per_s"] for r in rows]
if t:
    tps = statistics.median(t)
    open(sys.argv[6], "w").write(f"{tps}\n")
    fallback = (" **on the fallback kernels** (GANYMEDE_CUDA_ATTENTION=simt, "
                "GANYMEDE_CUDA_GROUPED=loop: the default ones failed, see above)"
                if name.endswith("-fallback") else "")
    print(f"- ganymede `{name}` ({len(rows)} steps, median of steps 3..; `{args or 'the preset'}`)"
          f"{fallback}: {tps:,.0f} tokens/s, MFU {tps * fpt / (peak * 1e12) * 100:.1f}%")
    # Time by phase (metrics.phase_times): events on the compute stream; a step's update is
    # read at the next step's end, so steps 3.. hold one update each.
    timed = rows[2:] or rows
    ph = [r["phase_ms"] for r in timed if "phase_ms" in r]
    if ph:
        step_ms = statistics.median(r["step_s"] for r in timed) * 1e3
        names = ["head", "attention", "dense", "router", "experts", "elementwise", "optimizer",
                 "communication"]
        names += sorted({k for p in ph for k in p} - set(names))
        cells = []
        for n in names:
            ms = statistics.median(p.get(n, 0.0) for p in ph)
            cells.append(f"{n} {ms:.1f} ms ({100 * ms / step_ms:.0f}%)")
        marks = statistics.median(r.get("phase_marks", 0) for r in timed)
        print(f"  - time by phase, median ms per step of {step_ms:.1f} ms ({marks:.0f} marks a "
              f"step): " + ", ".join(cells))
else:
    print(f"- ganymede `{name}`: no steps")
EOF
}
# PyTorch on the same shapes: TAG TIMEOUT EXTRA-ARGS; its tokens/s to $runs/TAG.tps. Experts
# through transformers' grouped_mm, its fastest; where that fails quickly (a version without
# it, or without it under autocast), once more with batched_mm, said so in the table.
torch_run() {
    local tag=$1 limit=$2
    shift 2
    local experts rc=1 t0 lim
    for experts in grouped_mm batched_mm; do
        t0=$(date +%s)
        lim=$(fit "$limit")
        if [ "$lim" = 0 ]; then
            echo "- PyTorch \`$tag\`: skipped, $((deadline - t0)) s left before the check's deadline" >>"$md"
            return
        fi
        timeout "$lim" "$py" "$root/bench/pytorch_qwen3moe.py" --preset medium --device cuda \
            --precision autocast-bf16 --experts "$experts" --fused "$@" --steps 8 --warmup 3 \
            --flops-per-token "$fpt" --peak-tflops "$peak" >"$runs/$tag.json" 2>"$runs/$tag.log"
        rc=$?
        [ $rc = 0 ] && break
        [ $rc != 124 ] && [ $(($(date +%s) - t0)) -lt 60 ] && [ "$experts" = grouped_mm ] || break
        echo "- PyTorch \`$tag\` with $experts experts: exit $rc ($(tail -1 "$runs/$tag.log")); trying batched_mm" >>"$md"
    done
    if [ $rc = 0 ]; then
        "$py" - "$runs/$tag.json" "$runs/$tag.tps" >>"$md" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
open(sys.argv[2], "w").write(f"{r['tokens_per_s']}\n")
print(f"- PyTorch {r['framework']} {r['precision']}, experts {r['experts']}, fused AdamW, "
      f"compile {r['compile']}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r.get('mfu', 0)*100:.1f}%, "
      f"peak {r.get('peak_memory_gib', 0):.1f} GiB")
EOF
    else
        echo "- PyTorch \`$tag\`: did not finish ($(tail -1 "$runs/$tag.log"))" >>"$md"
    fi
}
# Eager PyTorch right after ganymede, torch.compile (the slowest to start) last.
speed medium-adamw 150 12 --set optimizer.name=adamw
case " $torch_runs " in *" eager "*) torch_run torch-eager 150 ;; esac
speed medium-muon 120 8
# Issue 32: the experts' GEMMs on gemm.cu's kernel, which reads their rows from the device
# (GANYMEDE_CUDA_GROUPED=kernel: no count read-back in the step), against the library's grouped
# GEMM above. In a subshell, so that its failure sends no later run to the fallback kernels.
if [ $use_fallback = 0 ]; then
    (
        export GANYMEDE_CUDA_GROUPED=kernel
        speed medium-adamw-grouped-kernel 90 8 --set optimizer.name=adamw
        # The same step replayed as CUDA graphs (training.cuda_graphs), which needs the
        # experts' rows on the device (no read-back inside a graph).
        speed medium-adamw-graphs 90 8 --set optimizer.name=adamw --set training.cuda_graphs=true
    )
    "$py" - "$runs" >>"$md" <<'EOF'
import os, sys
def tps(n):
    try:
        return float(open(os.path.join(sys.argv[1], n + ".tps")).read())
    except (OSError, ValueError):
        return None
a, k = tps("medium-adamw"), tps("medium-adamw-grouped-kernel")
g = tps("medium-adamw-graphs")
if a and k:
    print(f"- experts on gemm.cu's kernel (device offsets, no read-back) / the library's grouped "
          f"GEMM: **{k / a:.3f}x** tokens/s (AdamW, medium)")
if k and g:
    print(f"- the step as CUDA graphs / launched from the host, both on gemm.cu's expert kernel: "
          f"**{g / k:.3f}x** tokens/s (AdamW, medium)")
EOF
fi
# Where medium's GPU time goes, op by op (3 AdamW steps, the first one's allocations included;
# events after every op slow the step, so this run is timed by nobody).
# On the fallback kernels where the speed run needed them.
[ "$profile" = 1 ] && (
    export GANYMEDE_CUDA_PROFILE=$out/profile-medium.md
    [ $use_fallback = 1 ] && export "${fallback_env[@]}"
    train medium-profile 90 --preset medium --steps 3 --set "device.kind=$kind" --set optimizer.name=adamw
)
if [ -f "$out/profile-medium.md" ]; then
    echo "- op profile of 3 AdamW steps: \`profile-medium.md\` ($(sed -n 1p "$out/profile-medium.md" | sed 's/.*: //'))" >>"$md"
fi
case " $torch_runs " in *" compile "*) torch_run torch-compile 200 --compile ;; esac
# The verdict the issue asks for: ganymede's AdamW run against PyTorch's best that finished.
"$py" - "$runs" >>"$md" <<'EOF'
import glob, os, sys
def tps(p):
    try:
        return float(open(p).read())
    except (OSError, ValueError):
        return None
g = tps(os.path.join(sys.argv[1], "medium-adamw.tps"))
torch = {os.path.basename(p)[:-4]: tps(p) for p in glob.glob(os.path.join(sys.argv[1], "torch-*.tps"))}
torch = {k: v for k, v in torch.items() if v}
if g and torch:
    best = max(torch, key=torch.get)
    r = g / torch[best]
    fb = (", ganymede on the fallback kernels"
          if os.path.isdir(os.path.join(sys.argv[1], "medium-adamw-fallback")) else "")
    print(f"- **ganymede / PyTorch's best ({best}): {r:.2f}x** "
          f"({'faster' if r > 1 else 'slower'}; AdamW both, bf16, no checkpointing{fb})")
else:
    print(f"- no ratio: ganymede {g}, PyTorch {torch or 'none finished'}")
EOF
echo "train check: see $md"
