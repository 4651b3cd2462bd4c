#!/usr/bin/env bash
# On the GPU machine (no Rust, no network): run the carried binary's device check with the CUDA
# libraries of a Python venv's NVIDIA wheels, in about 9 minutes, and leave markdown in OUTDIR:
# report.md (the binary's sections: smoke test, GEMM parity, GB/s, TFLOP/s, attention), train.md
# (scripts/device_train_check.sh: 50-step losses against the CPU, offload peaks against the
# planner, medium's tokens/s and MFU beside transformers'), anchors.md
# (scripts/device_anchor_check.sh, issue 32: `large` with AdamW and Muon against TorchTitan's own
# model, TorchTitan at medium, torch SDPA beside the attention table, the verdict lines),
# plan.md where asked (scripts/device_plan_check.sh: the planner fed a measured cluster file
# against medium and the europa-1t slice) and environment.md (GPU, libraries used, exit
# statuses and last lines).
# Every piece has its own deadline, counted from the start, so a slow one cannot eat the rest:
#   binary check 170 s; training check until 330 s; anchors until 540 s; the planner check
#   (GANYMEDE_PLAN_CHECK=1, off by default: it needs 420 s more) after.
# GANYMEDE_ANCHORS=0 skips the anchors (the training check then runs until 465 s, with its op
# profile and torch.compile row as before).
# Carry: target/dist/ganymede (scripts/device_build.sh) and bench/wheelhouse
# (scripts/fetch_wheelhouse.sh; TorchTitan's pure-Python wheels).
# Usage: scripts/device_check.sh OUTDIR   (GANYMEDE_BIN overrides target/dist/ganymede)
set -uo pipefail
out=${1:?usage: $0 OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${GANYMEDE_BIN:-$root/target/dist/ganymede}
env_md=$out/environment.md
start=$(date +%s)

# The wheels' library folders: ask every Python we can find for its site-packages (venvs
# differ in layout and Python version), then fall back to a bounded search of the disk.
dirs=()
add() { [ -d "$1" ] && case " ${dirs[*]-} " in *" $1 "*) ;; *) dirs+=("$1") ;; esac; }
pythons=("${GANYMEDE_PYTHON:-}" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" python3 python)
for v in /opt/torch/.venv /opt/venv /venv "$HOME/.venv" "$HOME/venv" "$HOME/.cache/ganymede/venv" "$root/.venv"; do
    pythons+=("$v/bin/python")
done
for py in "${pythons[@]}"; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    while IFS= read -r sp; do
        add "$sp/nvidia/cu13/lib"
        add "$sp/nvidia/nccl/lib"
    done < <(timeout 20 "$py" -c 'import site, sysconfig
paths = set(site.getsitepackages() + [site.getusersitepackages()] + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
print("\n".join(sorted(paths)))' 2>/dev/null)
done
if [ ${#dirs[@]} -eq 0 ]; then
    while IFS= read -r d; do add "$d"; done < <(timeout 60 find / -xdev -maxdepth 8 -type d \
        \( -path '*/nvidia/cu13/lib' -o -path '*/nvidia/nccl/lib' \) 2>/dev/null)
fi
if [ ${#dirs[@]} -gt 0 ]; then
    LD_LIBRARY_PATH=$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
fi

{
    echo "# Environment of the device check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), host $(hostname)"
    echo "- binary: $bin ($(stat -c %s "$bin" 2>/dev/null || echo missing) bytes)"
    echo "- CUDA library folders: ${dirs[*]:-none found}"
    echo
    echo '```'
    if command -v nvidia-smi >/dev/null; then
        timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    else
        echo "no nvidia-smi"
    fi
    for d in "${dirs[@]}"; do ls "$d" | grep -E '^lib(nvrtc|cublas|cublasLt|nccl)\.so' | sed "s|^|$d/|"; done
    echo '```'
} >"$env_md"

if [ ! -x "$bin" ]; then
    echo "no binary at $bin (build it with scripts/device_build.sh and carry it)" | tee -a "$env_md"
    exit 1
fi

anchors=${GANYMEDE_ANCHORS:-1}
# GANYMEDE_ANCHORS=only: the anchors alone, until 540 s (a second device run for what the first
# left out; the binary's check and the training check are not run).
only=0
[ "$anchors" = only ] && { only=1; anchors=1; }
if [ $only = 1 ]; then
    check_s=0 train_until=0 anchors_until=540
elif [ "$anchors" = 1 ]; then
    check_s=170 train_until=330 anchors_until=540
    # Within the 9 minutes: transformers eager only, no op profile (the anchors' TorchTitan
    # rows and torch.compile take their time).
    export GANYMEDE_CHECK_PROFILE=${GANYMEDE_CHECK_PROFILE:-0} GANYMEDE_CHECK_TORCH=${GANYMEDE_CHECK_TORCH:-eager}
else
    check_s=200 train_until=465 anchors_until=0
fi
rc=0
[ $only = 1 ] || { timeout $check_s "$bin" device-check --out "$out" >"$out/device-check.log" 2>&1; rc=$?; }
# A run that ended before writing a report (the one-line error) still leaves one; one that
# died or timed out in a section leaves the sections before it (written as they end) and why.
if [ $only = 1 ]; then
    :
elif [ ! -f "$out/report.md" ]; then
    { echo "# ganymede device check"; echo; echo "Did not run (exit $rc):"; echo; echo '```'; tail -20 "$out/device-check.log"; echo '```'; } >"$out/report.md"
elif [ $rc -ne 0 ] && [ $rc -ne 1 ]; then
    # 1 is "some section failed", already in the report; anything else ended the process.
    { echo; echo "## Ended early (exit $rc$([ $rc = 124 ] && echo ': timed out'))"; echo; echo '```'; tail -20 "$out/device-check.log"; echo '```'; } >>"$out/report.md"
fi

left=$((train_until - ($(date +%s) - start)))
# `timeout 0` would mean no limit at all.
[ "$left" -ge 30 ] || left=30
py=python3
for p in "${pythons[@]}"; do
    [ -n "$p" ] && "$p" -c 'import torch' >/dev/null 2>&1 && { py=$p; break; }
done
# The training check fits its runs to the deadline itself (an outer timeout would kill the
# script but leave its running child, in its own process group, on the GPU, and lose the closing
# verdict); the timeout is only a backstop.
# The deadline counts from the script's start (the probe for torch above takes seconds on a
# cold machine, and is not the training check's to spend).
deadline=$((start + train_until))
[ "$deadline" -ge $(($(date +%s) + 30)) ] || deadline=$(($(date +%s) + 30))
trc=skipped
if [ $only = 0 ]; then
    GANYMEDE_CHECK_DEADLINE=$deadline GANYMEDE_BIN=$bin GANYMEDE_PYTHON=$py \
        timeout $((left + 10)) "$root/scripts/device_train_check.sh" "$out" >"$out/train-check.log" 2>&1
    trc=$?
fi
# 3. The anchors (issue 32) until their own deadline; the script fits its runs to it and writes
#    its tables after (the timeout is a backstop).
arc=skipped
if [ "$anchors" = 1 ]; then
    adl=$((start + anchors_until))
    [ "$adl" -ge $(($(date +%s) + 60)) ] || adl=$(($(date +%s) + 60))
    GANYMEDE_ANCHOR_DEADLINE=$adl GANYMEDE_BIN=$bin GANYMEDE_PYTHON=$py \
        timeout $((adl - $(date +%s) + 30)) "$root/scripts/device_anchor_check.sh" "$out" >"$out/anchor-check.log" 2>&1
    arc=$?
fi
# 4. The planner against the device (issue 37): calibrate, plan and train medium and the
#    europa-1t slice, predicted against measured in plan.md; about 3 minutes more.
#    GANYMEDE_PLAN_CHECK=1 runs it (the default without the anchors).
prc=skipped
if [ "${GANYMEDE_PLAN_CHECK:-$((1 - anchors))}" = 1 ]; then
    GANYMEDE_BIN=$bin GANYMEDE_PYTHON=$py timeout 420 "$root/scripts/device_plan_check.sh" "$out" >"$out/plan-check.log" 2>&1
    prc=$?
fi
{
    echo
    echo "## Result"
    echo
    echo "- device-check exit status: $rc$([ $rc = 124 ] && echo ' (timed out)')"
    echo "- training check ($left s allowed, Python $py): exit $trc$([ $trc = 124 ] && echo ' (timed out)'); see train.md"
    echo "- anchor check (until $anchors_until s): exit $arc; see anchors.md"
    echo "- planner check: exit $prc; see plan.md"
    echo "- $(($(date +%s) - start)) s in all"
    echo
    echo '```'
    tail -20 "$out/device-check.log" 2>/dev/null
    echo '```'
} >>"$env_md"
echo "device check: exit $rc; see $out/report.md and $out/environment.md"
exit $rc
