#!/usr/bin/env python3
"""Recompute what examples/hf_dump.rs wrote with transformers' Qwen3MoeForCausalLM in float32:
the loss and every parameter's gradient. Exits non-zero on a mismatch.

    cargo run --release -p ganymede-model --example hf_dump -- /tmp/hf 1 1
    python crates/model/scripts/hf_check.py /tmp/hf
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def main() -> int:
    d = Path(sys.argv[1])
    m = json.loads((d / "manifest.json").read_text())
    c = m["config"]
    cfg = Qwen3MoeConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden"],
        intermediate_size=c["dense_hidden"] or c["expert_hidden"],
        moe_intermediate_size=c["expert_hidden"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"],
        num_experts=c["experts"],
        num_experts_per_tok=c["top_k"],
        norm_topk_prob=c["norm_topk_prob"],
        mlp_only_layers=list(range(c["dense_layers"])),
        rms_norm_eps=c["norm_eps"],
        rope_theta=c["rope_theta"],
        max_position_embeddings=max(c["seq_len"], 32),
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if hasattr(cfg, "rope_parameters") and isinstance(cfg.rope_parameters, dict):
        cfg.rope_parameters["rope_theta"] = c["rope_theta"]
    model = Qwen3MoeForCausalLM(cfg).float()
    ours = {}
    for p in m["params"]:
        x = np.fromfile(d / p["file"], dtype="<f4").reshape(p["shape"])
        g = np.fromfile(d / p["grad"], dtype="<f4").reshape(p["shape"])
        ours[p["name"]] = (torch.from_numpy(x), torch.from_numpy(g))
    sd = model.state_dict()
    mapping = {}  # HF name -> how to build it from ours
    for name in sd:
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            mapping[name] = ("cat", pre + "gate_proj", pre + "up_proj")
        elif name in ours:
            mapping[name] = ("same", name)
        else:
            print(f"no ganymede tensor for {name}")
            return 1
    with torch.no_grad():
        for name, how in mapping.items():
            if how[0] == "cat":
                sd[name].copy_(torch.cat([ours[how[1]][0], ours[how[2]][0]], dim=1))
            else:
                sd[name].copy_(ours[how[1]][0])
    b, t = m["batch"], m["seq"]
    inputs = torch.tensor(m["inputs"]).reshape(b, t)
    targets = torch.tensor(m["targets"]).reshape(-1)
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
    loss.backward()
    rel = abs(loss.item() - m["loss"]) / abs(loss.item())
    print(f"loss: transformers {loss.item():.7f}  ganymede {m['loss']:.7f}  rel diff {rel:.2e}")
    ok = rel < 1e-5
    params = dict(model.named_parameters())
    worst = 0.0
    for name, how in mapping.items():
        g = params[name].grad
        if how[0] == "cat":
            want = torch.cat([ours[how[1]][1], ours[how[2]][1]], dim=1)
        else:
            want = ours[how[1]][1]
        err = ((g - want).abs().max() / (g.abs().max() + 1e-12)).item()
        worst = max(worst, err)
        if err > 1e-3:
            print(f"gradient mismatch {name}: max rel {err:.2e}")
            ok = False
    print(f"gradients: worst max-relative difference {worst:.2e} over {len(mapping)} tensors")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
