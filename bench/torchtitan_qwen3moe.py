#!/usr/bin/env python3
"""The TorchTitan anchor (issue 32): TorchTitan's own Qwen3 MoE model (`torchtitan.models.qwen3`,
`Qwen3Model`; its experts are `torchtitan.models.common.moe.GroupedExperts` on
`torch._grouped_mm`) trained on the same shapes as ganymede's presets, on a GPU or, at a tiny
shape, on the CPU.

    PYTHONPATH=/tmp/site python bench/torchtitan_qwen3moe.py --preset large --device cuda \
        --fused [--compile] [--optimizer muon] --flops-per-token F --peak-tflops 989
    PYTHONPATH=/tmp/site python bench/torchtitan_qwen3moe.py --preset tiny --device cpu

TorchTitan comes from its pure-Python wheel and the pure-Python wheels it imports, installed
beside it without their dependencies (`scripts/fetch_wheelhouse.sh` fetches them; the device check
installs them with `pip install --no-index --no-deps --target`). Its `config_registry` (which
needs `datasets`) is not used: the model's config is built here with the package's own layer
builder (`_build_qwen3_moe_layers`, as its `30B-A3B` flavor is), at the preset's shape:
- fused QKV projection, q/k RMSNorm, RoPE (theta 1e6, ganymede's), untied embedding and head;
- 64 experts top-8 (the preset's), softmax router with normalised top-k weights, TorchTitan's
  auxiliary-loss-free load balancing (expert bias updated before each optimizer step, as its
  `register_moe_load_balancing_hook` does);
- attention: TorchTitan's `ScaledDotProductAttention` (causal SDPA, cuDNN then flash backends,
  GQA), as ganymede's causal attention without document masks. `--attn flex` uses the default
  of its language models (FlexAttention, compiled by TorchTitan itself) instead.

Precision as ganymede's preset: bf16 autocast over fp32 master weights and fp32 optimizer state
(the experts cast to bf16 in `GroupedExperts` themselves), every activation kept. `--compile`
compiles each transformer block (`fullgraph=True`), as TorchTitan's `apply_compile` does.
Gradient accumulation as ganymede's: `--accum` microbatches of `--micro-batch` sequences per
optimizer step (the preset's by default: `large` 16 x 2, the others one microbatch).

`--optimizer muon` splits the parameters as ganymede does (crates/optim `update_rule`):
`torch.optim.Muon` for the attention projections, with the fused QKV matrix orthogonalised as its
q, k and v blocks separately; every expert's w1, w2 and w3 matrix on its own through torch's own
Newton–Schulz (`torch.optim._muon._zeropower_via_newtonschulz`, bf16) and lr adjustment
(`match_rms_adamw`), batched over the experts of a stack (`--expert-ns batched`, the same
polynomial through `baddbmm`; `loop` runs torch's function one matrix at a time); AdamW for
embeddings, LM head, router and norms. Muon settings are ganymede's defaults: momentum 0.95
(Nesterov), 5 steps, weight decay 0.1.

Prints one JSON line in the format of bench/pytorch_qwen3moe.py: median tokens/s over the timed
optimizer steps (after warm-up), MFU where `--flops-per-token` and `--peak-tflops` are given (the
caller passes ganymede's planner's FLOPs per token; without it the same count is made here),
peak memory on a GPU, first and last losses. Tokens are random: only speed is measured.
"""
import argparse
import json
import statistics
import time

PRESETS = {
    # vocab, hidden, layers, heads, kv_heads, head_dim, experts, top_k, expert_hidden, seq,
    # micro-batch, accumulation (ganymede's presets; large: 16 microbatches of 2 a step)
    "tiny": (256, 64, 2, 4, 2, 16, 8, 2, 128, 128, 8, 1),
    "small": (4096, 256, 4, 8, 4, 32, 16, 4, 256, 256, 8, 1),
    "medium": (32768, 1024, 12, 16, 4, 64, 64, 8, 512, 4096, 4, 1),
    "large": (32768, 2048, 12, 32, 4, 64, 64, 8, 1024, 4096, 2, 16),
}
NS_COEFFS = (3.4445, -4.775, 2.0315)


def model_flops_per_token(v, h, layers, heads, kvh, hd, e, k, f, seq):
    """ganymede plan's model FLOPs per token: 6 x the active parameters but the embedding
    (attention projections, norms, router, top-k experts, final norm, LM head) plus causal
    attention, 12 x layers x heads·head_dim x seq/2 (forward 4 per key, backward twice that)."""
    per_layer = h * heads * hd * 2 + h * kvh * hd * 2 + 2 * h + 2 * hd + h * e + k * 3 * h * f
    return 6 * (layers * per_layer + h + v * h) + 12 * layers * heads * hd * (seq / 2)


def shim_for_older_torch():
    """TorchTitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims` at the top of its
    FSDP module (`torchtitan.distributed.fsdp`, reached from `torchtitan.models.qwen3` through its
    `parallelize`), a name torch 2.11 does not have. One GPU never wraps the model in FSDP, so a
    placeholder lets the package import; every other torch name its loaded modules import is in
    torch 2.11 (checked against the 2.11 wheel's Python files). Returns the names it put in."""
    import torch.distributed.fsdp as fsdp

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):

        class DataParallelMeshDims:  # noqa: D401 - a placeholder, never constructed here
            def __init__(self, *a, **k):
                raise RuntimeError("DataParallelMeshDims: FSDP is not available in this torch")

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    return added


def build_model(args, shape):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3 import _LINEAR_INIT

    v, h, layers, heads, kvh, hd, e, k, f, seq = shape
    import torch.nn as nn
    from functools import partial

    cfg = Qwen3Model.Config(
        vocab_size=v,
        dim=h,
        norm=_qwen3_norm(h),
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(
            num_embeddings=v,
            embedding_dim=h,
            param_init={"weight": partial(nn.init.normal_, std=0.02)},
        ),
        lm_head=Linear.Config(in_features=h, out_features=v, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=h,
            n_heads=heads,
            n_kv_heads=kvh,
            head_dim=hd,
            moe_hidden_dim=f,
            num_experts=e,
            top_k=k,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=hd, max_seq_len=seq, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )
    if args.attn == "sdpa":
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg, cfg.build()


def expert_bias_update(model):
    """TorchTitan's `register_moe_load_balancing_hook` update on one rank (run before each
    optimizer step): bias += coeff·sign(mean − count), recentred; counts reset."""
    import torch

    with torch.no_grad():
        for block in model.layers.values():
            moe = getattr(block, "moe", None)
            if moe is None or moe.load_balance_coeff is None:
                continue
            t = moe.tokens_per_expert_E.float()
            d = moe.load_balance_coeff * torch.sign(t.mean() - t)
            moe.expert_bias_E.add_(d - d.mean())
            moe.tokens_per_expert_E.zero_()


def ns_batched(g, steps, eps=1e-7):
    """torch.optim._muon._zeropower_via_newtonschulz over a stack of matrices [n, r, c] at
    once: the same bf16 polynomial, each matrix normalised by its own norm."""
    import torch

    a, b, c = NS_COEFFS
    x = g.bfloat16()
    tall = g.size(1) > g.size(2)
    if tall:
        x = x.transpose(1, 2)
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.transpose(1, 2))
        upd = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, upd, x, beta=a)
    if tall:
        x = x.transpose(1, 2)
    return x


def muon_classes():
    import torch
    import torch.optim._muon as tm
    from torch.optim._muon import _adjust_lr

    class BlockMuon(torch.optim.Optimizer):
        """torch.optim.Muon's update (Nesterov momentum, decoupled weight decay, bf16
        Newton–Schulz, `match_rms_adamw`) on matrices held in pieces: a fused QKV weight [q; k;
        v] as its three row blocks (`splits`), an expert stack [E, r, c] as its E matrices."""

        def __init__(self, params, lr, weight_decay, momentum, ns_steps, splits, batched):
            super().__init__(
                params,
                dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps),
            )
            self.splits = splits
            self.batched = batched

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                lr, wd, mu = g["lr"], g["weight_decay"], g["momentum"]
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - mu)
                    update = p.grad.lerp(buf, mu)
                    p.mul_(1 - lr * wd)
                    if p.ndim == 3:
                        alpha = -_adjust_lr(lr, "match_rms_adamw", p.shape[1:])
                        if self.batched:
                            p.add_(ns_batched(update, g["ns_steps"]).to(p.dtype), alpha=alpha)
                        else:
                            for e in range(p.shape[0]):
                                o = tm._zeropower_via_newtonschulz(
                                    update[e], NS_COEFFS, g["ns_steps"], 1e-7
                                )
                                p[e].add_(o, alpha=alpha)
                    else:
                        for pm, um in zip(
                            p.split(self.splits.get(p, [p.shape[0]])),
                            update.split(self.splits.get(p, [p.shape[0]])),
                        ):
                            o = tm._zeropower_via_newtonschulz(um, NS_COEFFS, g["ns_steps"], 1e-7)
                            pm.add_(o, alpha=-_adjust_lr(lr, "match_rms_adamw", pm.shape))

    return BlockMuon


def make_optimizers(model, args, shape):
    import torch

    v, h, layers, heads, kvh, hd = shape[:6]
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if args.device == "cuda" and args.fused:
        adamw["fused"] = True
    if args.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), **adamw)], {}
    attn, experts, rest, splits = [], [], [], {}
    for n, p in model.named_parameters():
        if ".attention." in n and p.ndim == 2 and "norm" not in n:
            attn.append(p)
            if p.shape[0] == (heads + 2 * kvh) * hd and "wqkv" in n.replace("_", ""):
                splits[p] = [heads * hd, kvh * hd, kvh * hd]
        elif ".routed_experts." in n and p.ndim == 3:
            experts.append(p)
        else:
            rest.append(p)
    muon = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, ns_steps=5)
    block = muon_classes()
    fused_qkv = list(splits)
    plain = [p for p in attn if p not in splits]
    opts = [
        torch.optim.Muon(plain, adjust_lr_fn="match_rms_adamw", **muon),
        block(fused_qkv + experts, splits=splits, batched=args.expert_ns == "batched", **muon),
        torch.optim.AdamW(rest, **adamw),
    ]
    split = {
        "muon_matrices": len(plain)
        + sum(len(s) for s in splits.values())
        + sum(p.shape[0] for p in experts),
        "adamw_tensors": len(rest),
    }
    return opts, split


def selftest():
    """Checks that can fail, without TorchTitan: the batched Newton–Schulz against torch's own
    per-matrix function, and the FLOPs per token against `ganymede plan --json`'s
    `flops.model_per_token` (tiny 942,336; medium 1,602,911,232; large 5,319,742,464)."""
    import torch
    import torch.optim._muon as tm

    torch.manual_seed(0)
    for shape in [(3, 24, 40), (2, 40, 24)]:
        g = torch.randn(*shape)
        got = ns_batched(g, 5).float()
        for i in range(shape[0]):
            want = tm._zeropower_via_newtonschulz(g[i], NS_COEFFS, 5, 1e-7).float()
            err = (got[i] - want).abs().max().item()
            # bf16 products either way; bmm and mm may round a partial sum differently.
            assert err < 2e-2, (shape, i, err)
    for name, want in [("tiny", 942_336), ("medium", 1_602_911_232), ("large", 5_319_742_464)]:
        got = model_flops_per_token(*PRESETS[name][:10])
        assert got == want, (name, got, want)
    print("selftest: pass")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--selftest", action="store_true", help="check the helpers and exit")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences per forward/backward")
    ap.add_argument("--accum", type=int, default=0, help="microbatches per optimizer step")
    ap.add_argument("--seq", type=int, default=0, help="override the sequence length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    ap.add_argument("--expert-ns", default="batched", choices=["batched", "loop"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "flex"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--fused", action="store_true", help="fused AdamW (GPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    ap.add_argument("--flops-per-token", type=float, default=0.0)
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    args = ap.parse_args()
    if args.selftest:
        return selftest()

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    v, h, layers, heads, kvh, hd, e, k, f, seq, mb, accum = PRESETS[args.preset]
    layers = args.layers or layers
    seq = args.seq or seq
    mb = args.micro_batch or mb
    accum = args.accum or accum
    shape = (v, h, layers, heads, kvh, hd, e, k, f, seq)

    shims = shim_for_older_torch()
    with torch.device(dev):
        cfg, model = build_model(args, shape)
        model.init_states()
    model.train()
    opts, split = make_optimizers(model, args, shape)
    if args.compile:
        # TorchTitan's apply_compile: each transformer block, whole graph.
        torch._dynamo.config.capture_scalar_outputs = True
        for block in model.layers.values():
            block.compile(backend="inductor", fullgraph=True)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)
    tokens = torch.randint(0, v, (accum, mb, seq + 1), device=dev)
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        total = 0.0
        for micro in range(accum):
            inputs, labels = tokens[micro, :, :-1], tokens[micro, :, 1:]
            with autocast:
                logits = model(inputs)
                loss = F.cross_entropy(logits.reshape(-1, v).float(), labels.reshape(-1))
            (loss / accum).backward()
            total = total + loss.detach() / accum
        expert_bias_update(model)
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        losses.append(float(total))
        if step >= args.warmup:
            times.append(dt)
    med = statistics.median(times)
    tps = accum * mb * seq / med
    fpt = args.flops_per_token or model_flops_per_token(*shape)
    extra = {"flops_per_token": fpt}
    if cuda:
        extra["gpu"] = torch.cuda.get_device_name(dev)
        extra["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if args.peak_tflops > 0:
        extra["mfu"] = tps * fpt / (args.peak_tflops * 1e12)
    import torchtitan

    print(
        json.dumps(
            {
                "framework": f"torchtitan {getattr(torchtitan, '__version__', '?')} "
                f"on pytorch {torch.__version__}",
                "model": "torchtitan.models.qwen3.Qwen3Model",
                "optimizer": args.optimizer,
                "preset": args.preset,
                "layers": layers,
                "seq": seq,
                "micro_batch": mb,
                "accum": accum,
                "device": args.device,
                "precision": "autocast-bf16",
                "experts": "GroupedExperts (torch._grouped_mm)",
                "attention": args.attn,
                "fused": args.fused and cuda,
                "compile": args.compile,
                "threads": args.threads,
                "params": sum(p.numel() for p in model.parameters()),
                "shims": shims,
                **split,
                "median_step_s": med,
                "step_s": times,
                "tokens_per_s": tps,
                "first_loss": losses[0],
                "last_loss": losses[-1],
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
