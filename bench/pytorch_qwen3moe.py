#!/usr/bin/env python3
"""The PyTorch anchor for BENCHMARKS.md: transformers' Qwen3MoeForCausalLM trained with AdamW on
the same shapes as ganymede's presets (no activation checkpointing), on CPU or on a GPU.

    python bench/pytorch_qwen3moe.py --preset tiny --threads 2 --steps 30
    python bench/pytorch_qwen3moe.py --preset small --optimizer muon
    python bench/pytorch_qwen3moe.py --preset medium --device cuda --precision autocast-bf16 \
        --experts grouped_mm --fused [--compile]

On a GPU the fast configuration is: bf16 compute (`autocast-bf16` keeps fp32 master weights and
fp32 AdamW state, as ganymede does; `bf16` makes the weights and state bf16 too, faster and less
exact), transformers' `grouped_mm` experts, SDPA attention, fused AdamW, optionally
`torch.compile`. `--flops-per-token` and `--peak-tflops` add an MFU figure (the caller passes the
same model FLOPs per token it uses for ganymede, so both share one numerator).

`--optimizer muon` splits the parameters as ganymede does: `torch.optim.Muon` for the attention
projections (2-D), Muon on every expert's gate, up and down matrix separately, and AdamW for
embeddings, LM head, router and norms. transformers 5.x stores a layer's experts as 3-D tensors
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), which `torch.optim.Muon` refuses (2-D only),
so `ExpertMuon` below applies torch's own Muon update (its `_zeropower_via_newtonschulz`, which
runs in bf16, and its lr adjustment) to each of the 3E matrices of a layer, one at a time as
`torch.optim.Muon` does for its parameters. Muon's settings are ganymede's defaults: momentum
0.95 (Nesterov), 5 steps, `match_rms_adamw` scaling, weight decay 0.1. `--optimizer muon-f32`
is the same with torch's Newton–Schulz run in f32 instead of bf16 (same code otherwise): on a CPU
without native bf16 arithmetic torch's bf16 matmuls are emulated and far slower than f32.

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
    "medium": (32768, 1024, 12, 16, 4, 64, 64, 8, 512, 4096, 4),
    # batch here is the microbatch: large accumulates 16 of them a step (ACCUM).
    "large": (32768, 2048, 12, 32, 4, 64, 64, 8, 1024, 4096, 2),
}
ACCUM = {"large": 16}


def make_optimizers(model, name, expert_hidden):
    import torch

    adamw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), **adamw)]
    attn, experts, rest = [], [], []
    for n, p in model.named_parameters():
        if ".self_attn." in n and p.ndim == 2:
            attn.append(p)
        elif ".mlp.experts." in n:
            experts.append(p)
        else:
            rest.append(p)
    if name == "muon-f32":
        import torch.optim._muon as tm

        tm._zeropower_via_newtonschulz = ns_f32
    muon = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, ns_steps=5)
    return [
        torch.optim.Muon(attn, adjust_lr_fn="match_rms_adamw", **muon),
        ExpertMuon(experts, rows=expert_hidden, **muon),
        torch.optim.AdamW(rest, **adamw),
    ]


def ns_f32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz with f32 in place of bf16."""
    import torch

    a, b, c = ns_coefficients
    x = grad.to(dtype=torch.float32, copy=True)
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def expert_muon_class():
    import torch
    import torch.optim._muon as tm
    from torch.optim._muon import _adjust_lr

    class ExpertMuon(torch.optim.Optimizer):
        """torch.optim.Muon's update on 3-D expert tensors: every [rows, :] block of every expert
        (gate and up halves of `gate_up_proj`, `down_proj` whole) is one matrix."""

        def __init__(self, params, lr, weight_decay, momentum, ns_steps, rows):
            super().__init__(
                params,
                dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps),
            )
            self.rows = rows

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                lr, wd, mu = g["lr"], g["weight_decay"], g["momentum"]
                for p in g["params"]:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - mu)
                    update = p.grad.lerp(buf, mu)
                    p.mul_(1 - lr * wd)
                    # gate_up_proj [E, 2I, H]: two I-row matrices; down_proj [E, H, I]: one.
                    chunks = p.shape[1] // self.rows if p.shape[1] > p.shape[2] else 1
                    for e in range(p.shape[0]):
                        for pm, um in zip(p[e].chunk(chunks), update[e].chunk(chunks)):
                            # Looked up at call time: muon-f32 replaces it.
                            o = tm._zeropower_via_newtonschulz(
                                um, (3.4445, -4.775, 2.0315), g["ns_steps"], 1e-7
                            )
                            pm.add_(o, alpha=-_adjust_lr(lr, "match_rms_adamw", pm.shape))

    return ExpertMuon


def ExpertMuon(*args, **kwargs):
    return expert_muon_class()(*args, **kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--accum", type=int, default=0, help="microbatches a step (preset's default)")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    ap.add_argument("--attn", default="sdpa", help="sdpa or eager")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon", "muon-f32"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--precision",
        default="f32",
        choices=["f32", "autocast-bf16", "bf16"],
        help="f32; bf16 autocast over fp32 weights; or bf16 weights and optimizer state",
    )
    ap.add_argument(
        "--experts", default=None, help="transformers' experts implementation (eager, grouped_mm, ...)"
    )
    ap.add_argument("--fused", action="store_true", help="fused AdamW (GPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--flops-per-token", type=float, default=0.0)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    args = ap.parse_args()

    import contextlib

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    v, h, layers, heads, kvh, hd, e, k, f, seq, batch = PRESETS[args.preset]
    layers = args.layers or layers
    accum = args.accum or ACCUM.get(args.preset, 1)
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
    if args.experts:
        cfg._experts_implementation = args.experts
    model = Qwen3MoeForCausalLM(cfg)
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(dev)
    model.train()
    opts = make_optimizers(model, args.optimizer, f)
    if args.fused:
        for o in opts:
            if isinstance(o, torch.optim.AdamW):
                for g in o.param_groups:
                    g["fused"] = True
    fwd = torch.compile(model) if args.compile else model
    autocast = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if args.precision == "autocast-bf16"
        else contextlib.nullcontext()
    )
    tokens = torch.randint(0, v, (accum, batch, seq + 1), device=dev)
    times, cpus, losses = [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        # Gradient accumulation (large): each microbatch's loss over `accum`, one step.
        for micro in range(accum):
            inputs, labels = tokens[micro, :, :-1], tokens[micro, :, 1:]
            with autocast:
                out = fwd(input_ids=inputs, output_router_logits=True)
                logits = out.logits
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, v).float(), labels.reshape(-1)
                )
                if out.aux_loss is not None:
                    loss = loss + cfg.router_aux_loss_coef * out.aux_loss
            (loss / accum).backward()
        for opt in opts:
            opt.step()
        # loss.item() waits for the step on a GPU; synchronize anyway so the time is the step's.
        if cuda:
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        # CPU time of the whole process (all threads), as ganymede's train_bench reports it.
        dc = time.process_time() - c0
        if step >= args.warmup:
            times.append(dt)
            cpus.append(dc)
    med = statistics.median(times)
    med_cpu = statistics.median(cpus)
    tps = accum * batch * seq / med
    extra = {}
    if cuda:
        extra["gpu"] = torch.cuda.get_device_name(dev)
        extra["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if args.flops_per_token > 0 and args.peak_tflops > 0:
        extra["mfu"] = tps * args.flops_per_token / (args.peak_tflops * 1e12)
    print(
        json.dumps(
            {
                "framework": f"pytorch {torch.__version__}",
                "optimizer": args.optimizer,
                "preset": args.preset,
                "device": args.device,
                "precision": args.precision,
                "experts": cfg._experts_implementation if args.experts else "default",
                "fused": args.fused,
                "compile": args.compile,
                "threads": args.threads,
                "params": sum(p.numel() for p in model.parameters()),
                "median_step_s": med,
                "median_cpu_s": med_cpu,
                "tokens_per_s": tps,
                "tokens_per_cpu_s": accum * batch * seq / med_cpu,
                "layers": layers,
                "accum": accum,
                "micro_batch": batch,
                "first_loss": losses[0],
                "last_loss": losses[-1],
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
