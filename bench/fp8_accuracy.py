"""fp8 attention's error with and without incoherent processing (a Hadamard rotation of Q and K).

    python bench/fp8_accuracy.py [--seqlen 1024] [--commit SHA] [--out DIR] [--kernel]

For each input kind, the RMSE of O against the float64 reference of the unquantised inputs:
  fp8            per-head e4m3 (fa_gen.fp8.quantize), computed as the kernel rounds
                 (fa_gen.reference.attention_fp8_same_precision, which L1 holds the kernel to)
  fp8_incoherent Q and K rotated first (fa_gen.fp8.quantize_qk_incoherent), same computation
  bf16           the inputs rounded to bf16, attention in fp32 (for scale)
With --kernel (on Hopper) the same two fp8 rows also through fa_gen.attention_fp8.

Input kinds (batch 1, 8 heads, d 128, no mask): "normal", N(0, 1); "outliers", N(0, 1) with 0.1%
of the entries times 10 (FlashAttention-3's experiment, section 4.3); "outlier_channels", 4 of
128 channels times 20 in Q and K (what LLM activations show).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa_gen import fp8  # noqa: E402
from fa_gen.reference import attention_fp8_same_precision, attention_reference  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402

SPEC = load_spec({"name": "fp8_accuracy", "dtype": "fp8_e4m3", "head_dim": 128, "mask": "none"})
HEADS, HEAD_DIM = 8, 128


def inputs(kind: str, seqlen: int, seed: int, device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, seqlen, HEADS, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(3))
    if kind == "outliers":
        for x in (q, k, v):
            spots = torch.rand(x.shape, generator=g) < 0.001
            x[spots] *= 10
    elif kind == "outlier_channels":
        channels = torch.randperm(HEAD_DIM, generator=g)[:4]
        q[..., channels] *= 20
        k[..., channels] *= 20
    return tuple(x.to(device) for x in (q, k, v))


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).pow(2).mean().sqrt())


def errors(kind: str, seqlen: int, seed: int, device, kernel: bool) -> dict:
    q, k, v = inputs(kind, seqlen, seed, device)
    truth, _ = attention_reference(q, k, v, SPEC)
    v8, vd = fp8.quantize(v)
    plain = fp8.quantize(q, heads_kv=HEADS) + fp8.quantize(k)
    rotated = fp8.quantize_qk_incoherent(q, k)
    row = {}
    for name, (q8, qd, k8, kd) in (("fp8", plain), ("fp8_incoherent", rotated)):
        row[name] = rmse(attention_fp8_same_precision(q8, k8, v8, (qd, kd, vd), SPEC), truth)
        if kernel:
            out, _ = fp8_kernel_call(q8, k8, v8, (qd, kd, vd))
            row[f"{name}_kernel"] = rmse(out, truth)
    bf = [x.to(torch.bfloat16).float() for x in (q, k, v)]
    row["bf16"] = rmse(attention_reference(*bf, SPEC)[0].float().to(torch.bfloat16), truth)
    row["incoherent_gain"] = row["fp8"] / row["fp8_incoherent"]
    return row


def fp8_kernel_call(q8, k8, v8, descales):
    import fa_gen

    return fa_gen.attention_fp8(q8, k8, v8, SPEC, *descales)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--kernel", action="store_true", help="also through the Hopper fp8 kernel")
    parser.add_argument("--commit", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device("cuda" if args.kernel else "cpu")
    result = {"commit": args.commit, "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if args.kernel else "cpu (PyTorch emulation of the kernel's rounding)",
              "command": " ".join(["python", "bench/fp8_accuracy.py", *sys.argv[1:]]),
              "shape": {"batch": 1, "seqlen": args.seqlen, "heads": HEADS, "head_dim": HEAD_DIM}, "rows": {}}
    for kind in ("normal", "outliers", "outlier_channels"):
        rows = [errors(kind, args.seqlen, seed, device, args.kernel) for seed in range(args.seeds)]
        mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
        result["rows"][kind] = mean
        print(f"{kind:17s} " + "  ".join(f"{key} {value:.3e}" if key != "incoherent_gain" else f"gain {value:.2f}x"
                                         for key, value in mean.items()), flush=True)
    if args.out:
        name = f"{datetime.date.today().isoformat()}-{args.commit or 'local'}-fp8-accuracy.json"
        (Path(args.out) / name).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
