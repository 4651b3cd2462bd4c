#!/usr/bin/env python3
"""Score a `ganymede export --format hf` directory with transformers' Qwen3MoeForCausalLM.

    hf_parity.py EXPORT_DIR TOKENS.bin SEQ_LEN [--batch N]

Computes what `ganymede eval --tokens TOKENS.bin --json` computes: the mean cross-entropy (nats
per target, auxiliary losses excluded) over consecutive, non-overlapping windows of SEQ_LEN + 1
tokens (inputs the first SEQ_LEN, targets the next; a final partial window is dropped), with the
model in float32. Prints one JSON object: {"loss": .., "tokens": ..}.
"""
import argparse
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeForCausalLM


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir")
    ap.add_argument("tokens")
    ap.add_argument("seq_len", type=int)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()

    tokens = np.fromfile(a.tokens, dtype="<u4").astype(np.int64)
    w = a.seq_len + 1
    n = len(tokens) // w
    if n == 0:
        print(f"error: {len(tokens)} tokens are fewer than one window of {w}", file=sys.stderr)
        return 1
    windows = torch.from_numpy(tokens[: n * w].reshape(n, w))

    try:
        model = Qwen3MoeForCausalLM.from_pretrained(
            a.export_dir, dtype=torch.float32, attn_implementation="eager"
        )
    except TypeError:  # older transformers spell it torch_dtype
        model = Qwen3MoeForCausalLM.from_pretrained(
            a.export_dir, torch_dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()

    total = 0.0
    with torch.no_grad():
        for i in range(0, n, a.batch):
            chunk = windows[i : i + a.batch]
            logits = model(input_ids=chunk[:, :-1]).logits
            # Logits are float32 like ganymede's; accumulate in float64.
            ce = F.cross_entropy(
                logits.double().reshape(-1, logits.shape[-1]),
                chunk[:, 1:].reshape(-1),
                reduction="sum",
            )
            total += ce.item()
    count = n * a.seq_len
    print(json.dumps({"loss": total / count, "tokens": count}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
