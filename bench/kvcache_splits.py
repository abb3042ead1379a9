"""Ad hoc (python bench/kvcache_splits.py): the KV-cache call's decode kernels (the varlen split
kinds: contiguous cache, pages of 16 / 64 / 256) against the fixed-length split kind
(fa_gen.inference.forward_split) on the same K/V, each at its own split heuristic and at the
other's split counts. GB/s of K+V, bench_decode's Timer, ROUNDS rounds in rotated order.
Writes $OUT/kvcache_splits.json when OUT is set."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import bench_decode as bd
import bench_paged as bp
import fa_gen
import fa_gen.inference as inf
from fa_gen.runtime import resolve_spec

ROUNDS = int(os.environ.get("ROUNDS", "2"))
CELLS = {(1, 131072): (0, 16, 32), (8, 32768): (0, 2, 4), (64, 8192): (0, 1, 2)}


def main():
    timer = bd.Timer()
    spec = resolve_spec(bd.fa_gen_spec(False, "bf16", 128))
    rows = []
    for (b, sk), splits in CELLS.items():
        fns = {}
        for page in (16, 64, 256):
            cell = bp.PagedCell(f"b{b}_p{page}", b, sk, 32, 8, page_size=page)
            x = bp.paged_inputs(cell)
            for s in splits:
                fns[f"paged{page}_s{s}"] = (lambda x=x, s=s: fa_gen.attention_with_kvcache(
                    x.q, x.k_pages, x.v_pages, x.seqlens, spec, page_table=x.page_table, num_splits=s))
            if page == 16:
                for s in splits:
                    fns[f"kvcache_s{s}"] = lambda x=x, s=s: fa_gen.attention_with_kvcache(x.q, x.k, x.v, x.seqlens, spec, num_splits=s)
                    fns[f"fixed_s{s}"] = lambda x=x, s=s: inf.forward_split(spec, x.q, x.k, x.v, num_splits=s or None)
        names = list(fns)
        nbytes = 2 * b * sk * 8 * 128 * 2
        res = bd.time_rounds(names, lambda n, first: {"impl": n, "ms": timer.median_ms(fns[n])}, ROUNDS)
        for r in res:
            r["gbps"] = nbytes / r["ms"] / 1e6
            rows.append({"cell": f"b{b}_sk{sk}", **r})
            print(f"b{b}_sk{sk}", r["impl"], round(r["gbps"]), [round(nbytes / m / 1e6) for m in r.get("ms_rounds", [])], flush=True)
        del fns
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kvcache_splits.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
