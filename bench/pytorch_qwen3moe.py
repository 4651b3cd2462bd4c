#!/usr/bin/env python3
"""The PyTorch anchor for BENCHMARKS.md: transformers' Qwen3MoeForCausalLM trained with AdamW on
the same shapes as ganymede's presets (no activation checkpointing), on CPU.

    python bench/pytorch_qwen3moe.py --preset tiny --threads 2 --steps 30

Prints one JSON line: median tokens/s over the timed steps (after warm-up), and the first and last
losses. Tokens are random, as only speed is measured.
"""
import argparse
import json
import statistics
import time

PRESETS = {
    # vocab, hidden, layers, heads, kv_heads, head_dim, experts, top_k, expert_hidden, seq, batch
    "tiny": (256, 64, 2, 4, 2, 16, 8, 2, 128, 128, 8),
    "small": (4096, 256, 4, 8, 4, 32, 16, 4, 256, 256, 8),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--attn", default="sdpa", help="sdpa or eager")
    args = ap.parse_args()

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    v, h, layers, heads, kvh, hd, e, k, f, seq, batch = PRESETS[args.preset]
    cfg = Qwen3MoeConfig(
        vocab_size=v,
        hidden_size=h,
        intermediate_size=f,
        moe_intermediate_size=f,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kvh,
        head_dim=hd,
        num_experts=e,
        num_experts_per_tok=k,
        norm_topk_prob=True,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
        output_router_logits=True,
        attn_implementation=args.attn,
    )
    model = Qwen3MoeForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, v, (batch, seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times, cpus, losses = [], [], []
    for step in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=inputs, output_router_logits=True)
        logits = out.logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, v), labels.reshape(-1))
        if out.aux_loss is not None:
            loss = loss + cfg.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        # CPU time of the whole process (all threads), as ganymede's train_bench reports it.
        dc = time.process_time() - c0
        if step >= args.warmup:
            times.append(dt)
            cpus.append(dc)
    med = statistics.median(times)
    med_cpu = statistics.median(cpus)
    print(
        json.dumps(
            {
                "framework": f"pytorch {torch.__version__}",
                "preset": args.preset,
                "threads": args.threads,
                "params": sum(p.numel() for p in model.parameters()),
                "median_step_s": med,
                "median_cpu_s": med_cpu,
                "tokens_per_s": batch * seq / med,
                "tokens_per_cpu_s": batch * seq / med_cpu,
                "first_loss": losses[0],
                "last_loss": losses[-1],
            }
        )
    )


if __name__ == "__main__":
    main()
