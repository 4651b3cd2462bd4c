"""Check that a tokenizer.json written by ganymede's BPE training loads in Python's `tokenizers`
and `transformers` and gives the same ids and text as ganymede.

    cargo run --release -p ganymede-data --example bpe_python_fixture -- /tmp/bpe-fixture
    python3 crates/data/scripts/check_tokenizer_python.py /tmp/bpe-fixture
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

d = Path(sys.argv[1] if len(sys.argv) > 1 else "bpe-fixture")
text = (d / "sample.txt").read_text(encoding="utf-8")
ours = json.loads((d / "ids.json").read_text())

tk = Tokenizer.from_file(str(d / "tokenizer.json"))
ids = tk.encode(text, add_special_tokens=False).ids
assert ids == ours, f"tokenizers differs at {next(i for i, (a, b) in enumerate(zip(ids, ours)) if a != b)}"
assert tk.decode(ids) == text

hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
ids = hf(text, add_special_tokens=False)["input_ids"]
assert ids == ours, "transformers differs"
assert hf.decode(ids, clean_up_tokenization_spaces=False) == text

print(f"ok: {len(ours)} ids match in tokenizers and transformers; decode round-trips")
