#!/usr/bin/env bash
# Tokenising speed per core, `ganymede data prepare` vs the Hugging Face `tokenizers` Python
# package (issue 33), for a GPT-2-style and a Qwen2/Qwen3-style tokenizer.json, on the same
# documents, with a check that both give identical ids.
#
#   bench/tokenize_vs_hf.sh            # 24 MB corpus, 32,000-id vocabularies, 3 repetitions
#   MB=8 REPS=5 bench/tokenize_vs_hf.sh
#
# Both tokenizers are trained here by the `tokenizers` package itself on the corpus, which is
# real text found on this machine (licences, copyright files, changelogs, and gettext
# translations in many languages); nothing is downloaded. Each repetition runs ganymede, then
# the package's encode_batch_fast, then encode_batch (round-robin, so a neighbour's load falls
# on all alike); the table gives medians. One core each: `--workers 1`, and for the package
# RAYON_NUM_THREADS=1 with TOKENIZERS_PARALLELISM=false (its batch loop then runs serially);
# the cpu/wall column shows what each really used.
#
# Env: MB (24), VOCAB (32000), REPS (3), WORK (/tmp/tokbench: venv, corpus, tokenizers; kept
#      between runs), PYTHON (python3, to make the venv), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
MB=${MB:-24}
VOCAB=${VOCAB:-32000}
REPS=${REPS:-3}
WORK=${WORK:-/tmp/tokbench}
mkdir -p "$WORK"
HERE=$(pwd)

if [ ! -x "$WORK/venv/bin/python" ] || ! "$WORK/venv/bin/python" -c "import tokenizers" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install -q tokenizers
fi
PY="$WORK/venv/bin/python"
HELPER="$HERE/bench/tokenize_vs_hf.py"

cargo build --release -q -p ganymede
BIN="${CARGO_TARGET_DIR:-$HERE/target}/release/ganymede"

CORPUS="$WORK/corpus-${MB}mb.jsonl"
[ -s "$CORPUS" ] || "$PY" "$HELPER" corpus "$CORPUS" "$MB"
for style in gpt2 qwen; do
  TOK="$WORK/${style}-${VOCAB}-${MB}mb.json"
  [ -s "$TOK" ] || "$PY" "$HELPER" train "$CORPUS" "$style" "$VOCAB" "$TOK"
done

export RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
for style in gpt2 qwen; do
  "$PY" "$HELPER" bench "$BIN" "$CORPUS" "$WORK/${style}-${VOCAB}-${MB}mb.json" "$REPS"
done
