"""MLA decode benchmark: fa_gen.mla_decode's GB/s as a fraction of the measured copy bandwidth,
beside FlashAttention-4 on the same shapes where it takes them.

    python bench/bench_mla.py --commit $(git rev-parse --short HEAD) --out DIR

Cells: bf16, seqlen_q 1 (and 2: multi-token decode, causal), query heads 16 (DeepSeek-V3 on 8
GPUs) or 128 (one GPU), one latent KV head of 576 columns (V its first 512), contiguous and
paged (page 64) caches, every sequence at seqlen_k. GB/s = bytes of the cache read (batch *
seqlen_k * 576 * 2) / time; "fraction of copy" divides by a device-to-device copy's (bytes
read + written) / time in the same run. Timing, L2 flush and the two clocks (device `ms`,
host-inclusive `ms_host`) are bench/bench_decode.py's. Each fa_gen cell is first checked
against fa_gen's float64 reference on batch entry 0. FA4 (flash_attn.cute.flash_attn_func with
k = the cache, v = its first 512 columns) records its error where it takes no such head dims.

Writes <out>/<date>-<commit>-mla.json and prints one line per cell.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import Timer, _with_meta, copy_bandwidth, gbps, time_impl  # noqa: E402
from fa_gen.mla import mla_decode, mla_reference  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402

# (batch, seqlen_q, heads_q, seqlen_k)
CELLS = [(64, 1, 16, 8192), (128, 1, 16, 8192), (32, 1, 16, 32768), (16, 1, 128, 8192), (64, 1, 128, 8192),
         (1, 1, 128, 65536), (64, 2, 16, 8192)]
PAGE = 64


def spec_for(seqlen_q: int):
    return load_spec({"name": f"mla_bench_q{seqlen_q}", "dtype": "bf16", "head_dim": {"qk": 576, "v": 512},
                      "mask": "causal", "softmax_scale": 192 ** -0.5})


def inputs(batch, seqlen_q, heads_q, seqlen_k, paged, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, 576, generator=g, device="cuda").to(torch.bfloat16)
    if not paged:
        return q, torch.randn(batch, seqlen_k, 1, 576, generator=g, device="cuda").to(torch.bfloat16), None
    pages = batch * (seqlen_k // PAGE)
    cache = torch.randn(pages, PAGE, 1, 576, generator=g, device="cuda").to(torch.bfloat16)
    table = torch.randperm(pages, generator=g, device="cuda").to(torch.int32).view(batch, -1).contiguous()
    return q, cache, table


def check(spec, q, cache, table, seqlen_k, out) -> float:
    ref, _ = mla_reference(q[:1], cache if table is not None else cache[:1], [seqlen_k], spec,
                           table[:1] if table is not None else None)[0]
    return float((out[0].double() - ref).abs().max())


def fa4(q, cache, seqlen_q):
    from flash_attn.cute import flash_attn_func

    k = cache
    return _with_meta(lambda: flash_attn_func(q, k, k[..., :512], causal=seqlen_q > 1),
                      call="flash_attn.cute.flash_attn_func(q, kv, kv[..., :512], causal=seqlen_q > 1)")


def run_cell(cell, paged, timer, copy_gbps):
    batch, seqlen_q, heads_q, seqlen_k = cell
    spec = spec_for(seqlen_q)
    q, cache, table = inputs(*cell, paged)
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    kv_bytes = batch * seqlen_k * 576 * 2
    result = {"batch": batch, "seqlen_q": seqlen_q, "heads_q": heads_q, "seqlen_k": seqlen_k, "paged": paged,
              "kv_bytes": kv_bytes, "results": []}
    out, _ = mla_decode(q, cache, seqlens, spec, block_table=table)
    result["fa_gen_max_abs_err_b0"] = check(spec, q, cache, table, seqlen_k, out)

    def work(ms):
        return {"gbps": gbps(kv_bytes, ms), "fraction_of_copy": gbps(kv_bytes, ms) / copy_gbps}

    fn = _with_meta(lambda: mla_decode(q, cache, seqlens, spec, block_table=table),
                    call="fa_gen.mla_decode(q, kv_cache, seqlens, spec, block_table=...)")
    result["results"].append(time_impl("fa_gen", lambda: fn, timer, work))
    if not paged:
        result["results"].append(time_impl("fa4", lambda: fa4(q, cache, seqlen_q), timer, work))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    timer = Timer()
    copy = copy_bandwidth(timer)
    cells = []
    for cell in CELLS:
        for paged in (False, True):
            r = run_cell(cell, paged, timer, copy["gbps"])
            cells.append(r)
            shown = "  ".join(f"{x['impl']} {x['gbps']:.0f} GB/s ({x['fraction_of_copy']:.2f} of copy, "
                              f"host {x['gbps_host']:.0f})" if "gbps" in x else
                              f"{x['impl']} {x.get('error') or x.get('unavailable')}"[:140] for x in r["results"])
            print(f"b{cell[0]} sq{cell[1]} h{cell[2]} sk{cell[3]} {'paged' if paged else 'contig'} "
                  f"err {r['fa_gen_max_abs_err_b0']:.1e}: {shown}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    date = dt.date.today().isoformat()
    record = {"commit": args.commit, "date": date, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "copy": copy, "cells": cells}
    path = args.out / f"{date}-{args.commit}-mla.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"copy {copy['gbps']:.0f} GB/s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
