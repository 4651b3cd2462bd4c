#!/usr/bin/env bash
# Muon vs AdamW on real text at tiny-like scale: byte-level, tiny with 4 layers (~0.87M
# parameters), 300 steps of 16 × 128 = 2,048 tokens, on this machine's Debian license/copyright
# texts. Each optimizer gets a learning-rate sweep at seed 1 (AdamW 4 points: its best of the
# first 3 sat at the edge); the best lr of each (by final
# validation loss) is then rerun at seed 2. Two runs at a time, one thread each (2 cores).
#
#   bench/muon_vs_adamw.sh            # prints the table; runs land in runs/muon_vs_adamw/
#
# Env: STEPS (300), ADAMW_LRS ("1e-3 3e-3 1e-2 3e-2"), MUON_LRS ("3e-3 1e-2 3e-2"), SEEDS ("1 2"),
#      JOBS (2), CARGO_TARGET_DIR (/work/target-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
ADAMW_LRS=${ADAMW_LRS:-1e-3 3e-3 1e-2 3e-2}
MUON_LRS=${MUON_LRS:-3e-3 1e-2 3e-2}
SEEDS=${SEEDS:-1 2}
JOBS=${JOBS:-2}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-bench}
ROOT=runs/muon_vs_adamw
TEXT=runs/debian-text.txt # runs/ is git-ignored: the gathered text must never be committed

cargo build --release -q -p ganymede -p ganymede-data --example gather_debian_text
BIN=$CARGO_TARGET_DIR/release/ganymede
[ -s "$TEXT" ] || { mkdir -p runs; "$CARGO_TARGET_DIR/release/examples/gather_debian_text" "$TEXT"; }
mkdir -p "$ROOT"
echo "# $(date -u +%FT%TZ) load: $(uptime)" >&2

one() { # optimizer lr seed
  local dir=$ROOT/$1-lr$2-seed$3
  [ -s "$dir/metrics.jsonl" ] && grep -q '"step":'"$STEPS"',' "$dir/metrics.jsonl" && return 0
  rm -rf "$dir"
  "$BIN" train --preset tiny --steps "$STEPS" --out "$dir" \
    --set model.layers=4 --set training.batch_size=16 \
    --set data.path="$TEXT" --set data.tokenizer=byte \
    --set optimizer.name="$1" --set optimizer.lr="$2" --set training.seed="$3" \
    --set training.threads=1 --set checkpoint.enable=false \
    --set metrics.val_every=100 --set metrics.val_batches=32 \
    >"$dir.log" 2>&1 || { echo "FAILED: $dir (see $dir.log)" >&2; return 1; }
  echo "done $dir $(( SECONDS ))s" >&2
}
# Run the listed "opt lr seed" jobs, JOBS at a time.
batch() {
  local spec
  for spec in "$@"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    one $spec &
  done
  wait
}
final_val() { # run dir -> last val_loss in metrics.jsonl
  python3 -c 'import json,sys
v=[json.loads(l).get("val_loss") for l in open(sys.argv[1]+"/metrics.jsonl")]
print([x for x in v if x is not None][-1])' "$1"
}

set -- $SEEDS
first_seed=$1; shift; other_seeds="$*"
specs=()
for lr in $ADAMW_LRS; do specs+=("adamw $lr $first_seed"); done
for lr in $MUON_LRS; do specs+=("muon $lr $first_seed"); done
batch "${specs[@]}"

best() { # optimizer lrs... -> the lr with the lowest final val loss at the first seed
  local opt=$1; shift
  for lr in "$@"; do echo "$(final_val "$ROOT/$opt-lr$lr-seed$first_seed") $lr"; done | sort -g | head -n1 | cut -d' ' -f2
}
best_adamw=$(best adamw $ADAMW_LRS)
best_muon=$(best muon $MUON_LRS)
specs=()
for s in $other_seeds; do specs+=("adamw $best_adamw $s" "muon $best_muon $s"); done
[ ${#specs[@]} -eq 0 ] || batch "${specs[@]}"

echo "# $(date -u +%FT%TZ) load: $(uptime)" >&2
grep -h "parameters" "$ROOT/adamw-lr$best_adamw-seed$first_seed.log" | head -n1 >&2 || true
echo "| optimizer | lr | seed | val loss @100 | @200 | @300 (final) | train loss @300 | tokens/s |"
echo "|---|---|---|---|---|---|---|---|"
for d in $(ls -d "$ROOT"/*/ | sort); do
  python3 - "$d" <<'PY'
import json, os, sys
d = sys.argv[1].rstrip("/")
opt, lr, seed = os.path.basename(d).replace("-lr", " ").replace("-seed", " ").split()
rows = [json.loads(l) for l in open(d + "/metrics.jsonl")]
val = {r["step"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
tps = sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2]
cell = lambda s: f"{val[s]:.3f}" if s in val else ""
print(f"| {opt} | {lr} | {seed} | {cell(100)} | {cell(200)} | {cell(rows[-1]['step'])} | {rows[-1]['loss']:.3f} | {tps:,.0f} |")
PY
done
python3 - "$ROOT" "$best_adamw" "$best_muon" $SEEDS <<'PY'
import json, statistics, sys
root, ba, bm, seeds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def fv(opt, lr, s):
    v = [json.loads(l).get("val_loss") for l in open(f"{root}/{opt}-lr{lr}-seed{s}/metrics.jsonl")]
    return [x for x in v if x is not None][-1]
a = [fv("adamw", ba, s) for s in seeds]
m = [fv("muon", bm, s) for s in seeds]
sd = lambda x: statistics.stdev(x) if len(x) > 1 else 0.0
print(f"\nbest AdamW (lr {ba}): {statistics.mean(a):.3f} ± {sd(a):.3f}  seeds {seeds}: {', '.join(f'{x:.3f}' for x in a)}")
print(f"best Muon  (lr {bm}): {statistics.mean(m):.3f} ± {sd(m):.3f}  seeds {seeds}: {', '.join(f'{x:.3f}' for x in m)}")
print(f"Muon - AdamW: {statistics.mean(m) - statistics.mean(a):+.3f} nats")
PY
