#!/usr/bin/env python3
"""The attention ceiling (issue 32): torch's scaled_dot_product_attention, forward and backward
TFLOP/s at ganymede's attention shapes (causal, bf16, GQA), per backend, as a markdown table.

    python bench/sdpa_ceiling.py                      # GPU: medium and large, flash and cuDNN
    python bench/sdpa_ceiling.py --device cpu --tiny  # CPU: a tiny shape on the math backend

Shapes are the presets' (batch = the sequences of one forward: medium 4, large's microbatch 2):
- medium: batch 4, seq 4,096, 16 query / 4 KV heads of 64 (the device check's own attention
  section times exactly this shape);
- large: batch 2, seq 4,096, 32 query / 4 KV heads of 64.

FLOPs as the device check's attention section counts them (crates/device-check, causal: half of
the T x T products): forward 4·B·H·T²·d / 2, backward 2.5 times the forward. Each backend is
given q, k, v with the KV heads repeated to the query heads (not every backend takes
`enable_gqa`; the repeat is outside the timed region, and the FLOPs are the query heads' either
way). A backend that refuses the shape gets a row saying why.
"""
import argparse
import statistics
import time

SHAPES = {
    # batch, seq, heads, kv_heads, head_dim
    "medium": (4, 4096, 16, 4, 64),
    "large": (2, 4096, 32, 4, 64),
    "tiny": (2, 128, 4, 2, 16),
}


def time_it(fn, sync, iters):
    fn()  # warm-up (and the backend's own first-call setup)
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape only (CPU tests)")
    ap.add_argument("--shapes", default="medium,large")
    ap.add_argument("--backends", default="", help="comma list: flash,cudnn,efficient,math")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    backends = args.backends.split(",") if args.backends else (
        ["flash", "cudnn"] if cuda else ["math"]
    )
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    gpu = torch.cuda.get_device_name(dev) if cuda else "CPU"
    print(f"torch {torch.__version__} SDPA on {gpu}, causal, bf16; FLOPs causal (half the "
          "T x T products), backward counted as 2.5 x forward\n")
    print("| shape | backend | forward ms | forward TFLOP/s | backward ms | backward TFLOP/s |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for shape in shapes:
        b, t, h, kvh, d = SHAPES[shape]
        q = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, kvh, t, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, kvh, t, d, device=dev, dtype=torch.bfloat16)
        k, v = (x.repeat_interleave(h // kvh, dim=1).contiguous() for x in (k, v))
        dout = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16)
        fwd_flops = 4.0 * b * h * t * t * d / 2
        label = f"{shape} (B {b}, T {t}, {h}/{kvh} heads of {d})"
        for name in backends:
            qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
            try:
                with sdpa_kernel([names[name]]):
                    def fwd():
                        with torch.no_grad():
                            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

                    t_f = time_it(fwd, sync, args.iters)
                    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)

                    def bwd():
                        torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)

                    t_b = time_it(bwd, sync, args.iters)
                print(f"| {label} | {name} | {t_f * 1e3:.3f} | {fwd_flops / t_f / 1e12:.4g} "
                      f"| {t_b * 1e3:.3f} | {2.5 * fwd_flops / t_b / 1e12:.4g} |")
            except Exception as e:  # a backend that refuses the shape or the GPU
                why = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
                print(f"| {label} | {name} | - | - | - | - ({why.replace('|', '/')}) |")


if __name__ == "__main__":
    main()
