#!/usr/bin/env bash
# Train-step throughput, ganymede vs PyTorch (transformers' Qwen3MoeForCausalLM + AdamW), side by
# side: every repetition runs each configuration once, in turn (round-robin), so a neighbour's
# load falls on all of them alike; the table gives medians over repetitions.
#
#   bench/run_speed.sh                 # 2 threads, 5 repetitions, tiny and small
#   THREADS=1 REPS=3 bench/run_speed.sh
#
# Env: THREADS (2), REPS (5), PRESETS ("tiny small"), CONFIGS (ganymede runs, below),
#      PT_OPTIMIZERS (PyTorch runs: "adamw", "muon" or both, e.g. "muon adamw"; ratios are
#      to the first), BASE_BENCH (a train_bench binary built from another commit: its runs join
#      every repetition too, labelled "base ..."),
#      PT_STEPS, PT_WARMUP (PyTorch's timed and warm-up steps, if fewer than ganymede's: its
#      bf16 Newton–Schulz is slow on a CPU without native bf16),
#      PYTHON (/root/venv-ref/bin/python),
#      CARGO_TARGET_DIR (/work/target-bench), OUT (results file; default a temp file),
#      BUSY (1: keep one core busy with `yes > /dev/null` throughout, to see how each side
#      degrades when a neighbour takes a core).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
REPS=${REPS:-5}
PRESETS=${PRESETS:-tiny small}
CONFIGS=${CONFIGS:-adamw none,adamw full,muon none,muon full} # ganymede "optimizer ac-mode" list
PT_OPTIMIZERS=${PT_OPTIMIZERS:-adamw}
PYTHON=${PYTHON:-/root/venv-ref/bin/python}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-bench}
OUT=${OUT:-$(mktemp /tmp/run_speed.XXXXXX.jsonl)}

cargo build --release -q -p ganymede-train --example train_bench
BENCH=$CARGO_TARGET_DIR/release/examples/train_bench

# Timed steps per run: enough for a stable median, short enough to interleave often.
steps_of() { case $1 in tiny) echo 30 ;; *) echo 8 ;; esac; }

echo "# $(date -u +%FT%TZ)  $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; threads=$THREADS reps=$REPS" >&2
echo "# load before: $(uptime)" >&2
: >"$OUT"
if [ "${BUSY:-0}" = 1 ]; then
  yes >/dev/null &
  busy_pid=$!
  trap 'kill "$busy_pid"' EXIT
  echo "# one core kept busy by yes (pid $busy_pid)" >&2
fi
for rep in $(seq 1 "$REPS"); do
  for p in $PRESETS; do
    n=$(steps_of "$p")
    run() { # label, command...
      local label=$1; shift
      local line
      line=$("$@" | tail -n 1)
      echo "{\"rep\": $rep, \"label\": \"$label\", \"result\": $line}" >>"$OUT"
      echo "rep $rep $p $label: $line" >&2
    }
    for o in $PT_OPTIMIZERS; do
      run "pytorch $o" env OMP_NUM_THREADS="$THREADS" "$PYTHON" bench/pytorch_qwen3moe.py \
        --preset "$p" --threads "$THREADS" --steps "${PT_STEPS:-$n}" --warmup "${PT_WARMUP:-3}" \
        --optimizer "$o"
    done
    IFS=, read -ra cfgs <<<"$CONFIGS"
    for cfg in "${cfgs[@]}"; do
      set -- $cfg
      for side in ${BASE_BENCH:+base} ganymede; do
        bin=$BENCH
        [ "$side" = base ] && bin=$BASE_BENCH
        run "$side $1 ac=$2" "$bin" "$p" --steps "$n" --warmup 3 \
          --set training.threads="$THREADS" --set optimizer.name="$1" \
          --set activation_checkpoint.mode="$2"
      done
    done
  done
done
echo "# load after: $(uptime)" >&2
echo "# raw results: $OUT" >&2

python3 bench/speed_table.py "$OUT"
