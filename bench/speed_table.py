#!/usr/bin/env python3
"""Table of bench/run_speed.sh results (a JSONL file, possibly partial): medians over repetitions,
and the ratio to PyTorch taken per repetition (same load) before the median."""
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = statistics.median
print("| preset | run | threads | tokens/s (median) | min–max | vs PyTorch | tokens per CPU-s | optimizer ms/step | CPU ms/step | reps |")
print("|---|---|---|---|---|---|---|---|---|---|")
for preset in dict.fromkeys(r["result"]["preset"] for r in rows):
    mine = [r for r in rows if r["result"]["preset"] == preset]
    # Ratios are to the first PyTorch run of each repetition (run_speed.sh's first PT_OPTIMIZERS).
    first = next(r["label"] for r in mine if r["label"].startswith("pytorch"))
    ref = {r["rep"]: r["result"]["tokens_per_s"] for r in mine if r["label"] == first}
    for label in dict.fromkeys(r["label"] for r in mine):
        rs = [r for r in mine if r["label"] == label]
        tps = [r["result"]["tokens_per_s"] for r in rs]
        # Ratio per repetition (same load), then the median of those ratios.
        ratio = med([r["result"]["tokens_per_s"] / ref[r["rep"]] for r in rs if r["rep"] in ref])
        opt = med([r["result"].get("median_opt_s", float("nan")) for r in rs]) * 1e3
        print(f"| {preset} | {label} | {rs[0]['result']['threads']} | {med(tps):,.0f} | "
              f"{min(tps):,.0f}–{max(tps):,.0f} | {ratio:.2f}× | "
              f"{med([r['result']['tokens_per_cpu_s'] for r in rs]):,.0f} | "
              f"{'—' if label.startswith('pytorch') else f'{opt:.1f}'} | "
              f"{med([r['result']['median_cpu_s'] for r in rs]) * 1e3:.1f} | {len(rs)} |")
