"""Ad hoc (python bench/decode_intercept.py): where a decode cell's time goes, fixed cost or
streaming rate. For a few (batch, query heads, KV heads) it times fa_gen and the anchors at
several seqlen_k (same grid, more keys per CTA) and fits ms = intercept + bytes / rate per
implementation: the rate is the steady streaming bandwidth, the intercept what a call costs
beyond it (launch ramp, the first loads of every wave of CTAs, the tail, the epilogue).
bench_decode's Timer and implementations; ROUNDS rounds in rotated order.
Writes $OUT/decode_intercept.json when OUT is set."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import bench_decode as bd

ROUNDS = int(os.environ.get("ROUNDS", "2"))
IMPLS = os.environ.get("IMPLS", "fa_gen_split,fa4,sdpa_cudnn").split(",")
SHAPES = {(128, 64, 8): (1024, 2048, 4096, 8192), (64, 32, 8): (2048, 4096, 8192, 16384)}


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def main():
    timer = bd.Timer()
    out = []
    for (b, hq, hkv), lengths in SHAPES.items():
        points = {impl: [] for impl in IMPLS}
        for sk in lengths:
            cell = bd.DecodeCell(f"b{b}_sk{sk}_h{hq}/{hkv}", b, sk, hq, hkv)
            r = bd.run_decode_cell(cell, IMPLS, timer, 1.0, rounds=ROUNDS)
            for x in r["results"]:
                if "ms" in x:
                    points[x["impl"]].append((cell.kv_bytes, x["ms"]))
            print(cell.name, {x["impl"]: round(x.get("gbps", 0)) for x in r["results"]}, flush=True)
        for impl, p in points.items():
            if len(p) >= 2:
                slope, icpt = fit([x for x, _ in p], [y for _, y in p])
                row = {"shape": f"b{b}_h{hq}/{hkv}", "impl": impl, "rate_gbps": 1e-6 / slope,
                       "intercept_us": icpt * 1e3, "points": p}
                out.append(row)
                print(row["shape"], impl, "rate", round(row["rate_gbps"]), "GB/s, intercept", round(row["intercept_us"], 1), "us", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "decode_intercept.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
