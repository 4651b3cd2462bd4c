#!/usr/bin/env python3
"""Helpers for the Hugging Face import/export tests (crates/ganymede/tests/hf_roundtrip.rs).

    hf_roundtrip.py make {moe,dense} OUT --tokenizer TOKENIZER.json --vocab V
                    [--max-shard-size SIZE] [--tied] [--fused] [--seed S]
        A tiny Qwen3MoeForCausalLM / Qwen3ForCausalLM with random weights (norms and router
        included, so every tensor matters), saved by save_pretrained in float32 (sharded at SIZE),
        or with --fused as the in-memory state dict (experts as 3-D gate_up_proj/down_proj).
    hf_roundtrip.py loss DIR TOKENS.bin SEQ_LEN
        What `ganymede eval --tokens TOKENS.bin --json` computes, with AutoModelForCausalLM in
        float32 (refusing missing or unexpected weights): {"loss": .., "tokens": .., "architecture": ..}.
    hf_roundtrip.py same A B
        Every tensor of folder A equals B's bit for bit (same names, shapes, dtypes):
        {"tensors": n, "differ": [...]}.
    hf_roundtrip.py check HF EXPORT TOKENS.bin SEQ_LEN
        `loss` of both folders and `same` of the two, in one process:
        {"loss": .., "export_loss": .., "architecture": .., "tensors": n, "differ": [...]}.
    hf_roundtrip.py load DIR
        AutoModelForCausalLM loads DIR with no missing or unexpected weights:
        {"architecture": .., "parameters": ..}.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig


def make(a):
    torch.manual_seed(a.seed)
    common = dict(
        vocab_size=a.vocab,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=a.tied,
    )
    if a.kind == "moe":
        cfg = Qwen3MoeConfig(
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
            **common,
        )
    else:
        cfg = Qwen3Config(num_hidden_layers=2, intermediate_size=128, **common)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.eval()
    os.makedirs(a.out, exist_ok=True)
    if a.fused:
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if a.tied:
            sd.pop("lm_head.weight", None)
        save_file(sd, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(a.out)
    else:
        model.save_pretrained(a.out, max_shard_size=a.max_shard_size, safe_serialization=True)
    shutil.copy(a.tokenizer, os.path.join(a.out, "tokenizer.json"))
    names = sorted(tensors(a.out))
    print(json.dumps({"files": sorted(f for f in os.listdir(a.out) if f.endswith(".safetensors")),
                      "tensors": len(names), "sample": names[:3]}))


def files_of(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def tensors(d):
    out = {}
    for fn in files_of(d):
        with safe_open(os.path.join(d, fn), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def differing(x, y):
    differ = sorted(set(x) ^ set(y))
    for k in sorted(set(x) & set(y)):
        u, v = x[k], y[k]
        if u.dtype != v.dtype or u.shape != v.shape or not torch.equal(
            u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)
        ):
            differ.append(k)
    return differ


def same(a):
    x = tensors(a.a)
    print(json.dumps({"tensors": len(x), "differ": differing(x, tensors(a.b))}))


def load_model(d):
    model, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        print(f"error: loading {d}: {bad}", file=sys.stderr)
        sys.exit(1)
    model.eval()
    return model


def mean_loss(d, tokens_file, seq_len):
    tokens = np.fromfile(tokens_file, dtype="<u4").astype(np.int64)
    w = seq_len + 1
    n = len(tokens) // w
    windows = torch.from_numpy(tokens[: n * w].reshape(n, w))
    model = load_model(d)
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 8):
            chunk = windows[i : i + 8]
            logits = model(input_ids=chunk[:, :-1]).logits
            total += F.cross_entropy(
                logits.double().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
            ).item()
    return total / (n * seq_len), n * seq_len, type(model).__name__


def loss(a):
    l, n, arch = mean_loss(a.dir, a.tokens, a.seq_len)
    print(json.dumps({"loss": l, "tokens": n, "architecture": arch}))


def check(a):
    l, _, _ = mean_loss(a.hf, a.tokens, a.seq_len)
    le, _, arch = mean_loss(a.export, a.tokens, a.seq_len)
    x = tensors(a.hf)
    print(json.dumps({"loss": l, "export_loss": le, "architecture": arch, "tensors": len(x),
                      "differ": differing(x, tensors(a.export))}))


def load(a):
    model = load_model(a.dir)
    print(json.dumps({"architecture": type(model).__name__,
                      "parameters": sum(p.numel() for p in model.parameters())}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("kind", choices=["moe", "dense"])
    m.add_argument("out")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--vocab", type=int, required=True)
    m.add_argument("--max-shard-size", default="40KB")
    m.add_argument("--tied", action="store_true")
    m.add_argument("--fused", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("same")
    s.add_argument("a")
    s.add_argument("b")
    l = sub.add_parser("loss")
    l.add_argument("dir")
    l.add_argument("tokens")
    l.add_argument("seq_len", type=int)
    c = sub.add_parser("check")
    c.add_argument("hf")
    c.add_argument("export")
    c.add_argument("tokens")
    c.add_argument("seq_len", type=int)
    d = sub.add_parser("load")
    d.add_argument("dir")
    a = ap.parse_args()
    {"make": make, "same": same, "loss": loss, "check": check, "load": load}[a.cmd](a)


if __name__ == "__main__":
    main()
