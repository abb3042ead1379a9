"""Sweep the sm80 backward's tile configurations on the device: compile every candidate in
parallel, check each against float64 autograd at one ragged GQA shape, time it beside SDPA's
flash backend (FlashAttention-2) at bench/bench_backward_sm90.py's shapes, write JSON.

    python bench/sweep_sm80_bwd.py --out DIR [--head-dims 64,256] [--seqlens 4096,16384]

A candidate is a BackwardTileConfig (tile_m, tile_n, num_warps, num_stages, sdp_warps_m,
dkv_warps_n, dq_warps_m, dq_first) and the fp32 values per dQ atomic (1, or 4 on sm_90), set per
call by overriding Sm80Family.kind_context, as bench_backward_sm90's --variant does for sm90.
Commit-worthy winners go in fa_gen/families/sm80.py's `_backward_candidates`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_backward_sm90 import HEADS, TOKENS, sdpa_backward, spec_for, time_ms  # noqa: E402
from sweep_sm90 import power_steady_state  # noqa: E402

ARCH = "sm_90a"
# Candidates per head dim: (BackwardTileConfig fields, fp32 values per dQ atomic).
CANDIDATES = {
    64: [((128, 128, 8, 2, 2, 4, 4, True), 1), ((128, 128, 8, 2, 2, 4, 4, True), 4)],
    128: [((64, 128, 8, 2, 2, 4, 2, False), 1), ((64, 128, 8, 2, 2, 4, 2, False), 4)],
    192: [((64, 64, 8, 2, 2, 4, 2, False), 1), ((64, 64, 8, 2, 4, 2, 4, False), 1),
          ((64, 64, 8, 2, 4, 2, 4, False), 4)],
    256: [((64, 64, 8, 2, 4, 2, 4, False), 1), ((64, 64, 8, 2, 4, 2, 4, False), 4)],
}


def use_candidate(cfg: tuple, dq_atomic_width: int) -> None:
    """Render the sm80 backward with this candidate from now on (this process only)."""
    from fa_gen import backward as backward_mod
    from fa_gen.families import sm80

    original = getattr(sm80.Sm80Family, "_original_kind_context", sm80.Sm80Family.kind_context)
    sm80.Sm80Family._original_kind_context = original
    tiles = dict(zip(sm80.BackwardTileConfig.__dataclass_fields__, cfg))
    # Every key derived from the tile config, not only "bwd" (P/dS swizzle atoms follow tile_n).
    derived = {"bwd": tiles, "smem_atom_cols_pds": sm80.smem_atom_cols(tiles["tile_n"]),
               "dq_atomic_width": dq_atomic_width}

    def kind_context(self, spec, arch, kind):
        context = original(self, spec, arch, kind)
        return {**context, **derived} if kind == "backward" else context
    sm80.Sm80Family.kind_context = kind_context
    backward_mod._BACKWARDS.clear()


def _compile(head_dim: int, causal: bool, cfg: tuple, dq_atomic_width: int) -> float:
    from fa_gen.backward import build_backward
    from fa_gen.runtime import build

    use_candidate(cfg, dq_atomic_width)
    build(spec_for(head_dim, causal), ARCH, family="sm80")
    return build_backward(spec_for(head_dim, causal), ARCH, family="sm80").info.seconds


def compile_all(jobs: list[tuple], workers: int) -> None:
    context = multiprocessing.get_context("spawn")  # no inherited CUDA or DSL state
    with futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        list(pool.map(_compile, *zip(*jobs)))


def check(head_dim: int, causal: bool) -> list[float]:
    """Max error of dQ, dK, dV over the float64 gradient's max, at a ragged GQA shape."""
    from fa_gen.backward import build_backward
    from fa_gen.check import Shape, random_inputs
    from fa_gen.reference import attention_reference
    from fa_gen.runtime import build

    spec = spec_for(head_dim, causal)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = random_inputs(spec, Shape(2, 300, 517, 4, 2), torch.bfloat16, "cuda", gen)
    dout = torch.randn(*q.shape, generator=gen, device="cuda").to(q.dtype)
    out, lse = build(spec, ARCH, family="sm80").forward(q, k, v)
    got = build_backward(spec, ARCH, family="sm80")(dout, q, k, v, out, lse)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    attention_reference(*leaves, spec)[0].backward(dout.double())
    return [round(float((g.double() - x.grad).abs().max() / x.grad.abs().max()), 5) for g, x in zip(got, leaves)]


def time_candidate(head_dim: int, causal: bool, seqlen: int) -> tuple[float, float]:
    """(TFLOP/s of the current candidate, of SDPA's flash backend) at one benchmark shape."""
    from fa_gen.backward import build_backward
    from fa_gen.runtime import build

    spec = spec_for(head_dim, causal)
    batch = max(TOKENS // seqlen, 1)
    gen = torch.Generator(device="cuda").manual_seed(seqlen)
    q, k, v, dout = (torch.randn(batch, seqlen, HEADS, head_dim, device="cuda", generator=gen,
                                 dtype=torch.bfloat16) for _ in range(4))
    out, lse = build(spec, ARCH, family="sm80").forward(q, k, v)
    backward = build_backward(spec, ARCH, family="sm80")
    flops = 2.5 * 4 * batch * HEADS * seqlen * seqlen * head_dim / (2 if causal else 1)
    ms = time_ms(lambda: backward(dout, q, k, v, out, lse))
    # The anchor beside every candidate: ratios within one shape stay comparable as clocks drift.
    ms_flash = time_ms(sdpa_backward("FLASH_ATTENTION")(spec, q, k, v, dout))
    return round(flops / ms / 1e9, 1), round(flops / ms_flash / 1e9, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--head-dims", default="64,128,192,256")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    head_dims = [int(d) for d in args.head_dims.split(",")]
    seqlens = [int(s) for s in args.seqlens.split(",")]
    jobs = [(d, causal, cfg, width) for d in head_dims for causal in (False, True) for cfg, width in CANDIDATES[d]]
    start = time.perf_counter()
    compile_all(jobs, args.jobs)
    print(f"compiled {len(jobs)} candidates in {time.perf_counter() - start:.0f} s", flush=True)

    power_steady_state()
    rows = []
    for d, causal, cfg, width in jobs:
        use_candidate(cfg, width)
        row = {"head_dim": d, "causal": causal, "config": cfg, "dq_atomic_width": width,
               "rel_err_dq_dk_dv": check(d, causal), "tflops": {}, "sdpa_flash": {}}
        for seqlen in seqlens:
            row["tflops"][seqlen], row["sdpa_flash"][seqlen] = time_candidate(d, causal, seqlen)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out) / "sweep_sm80_bwd.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
