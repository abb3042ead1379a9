"""Ad hoc: fa_gen split-KV decode GB/s per cell under tile and split choices (beside a D2D copy)."""
import json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import bench_decode as bd
import fa_gen.families.sm80 as sm80
import fa_gen.inference as inf
from fa_gen.runtime import resolve_spec

# TILES="64,64,4,2;64,64,4,3" (tile_m, tile_n, warps, stages); SPLITS="0,1,4,16" (0: the heuristic's)
TILES = {f"{t[0]}x{t[1]}s{t[3]}": t for t in (tuple(map(int, x.split(","))) for x in
         os.environ.get("TILES", "64,128,4,2;64,64,4,2").split(";"))}
SPLITS = [int(x) or None for x in os.environ.get("SPLITS", "0,1,4,16").split(",")]
CELLS = [c for c in bd.DECODE_CELLS if not os.environ.get("CELLS") or c.name in os.environ["CELLS"].split(",")]


def _patch(tname):
    sm80.split_tile_config = lambda spec, arch, wide=False: sm80.TileConfig(*TILES[tname])
    inf.inference_kernel.cache_clear()
    inf.kind_tiles.cache_clear()


def _build(tname, spec, kind):
    _patch(tname)
    inf.inference_kernel(resolve_spec(spec), inf.current_arch(), kind)
    return tname, kind


def precompile():
    from concurrent import futures
    import multiprocessing
    work = []
    for cell in CELLS:
        spec = bd.fa_gen_spec(False, cell.dtype, cell.head_dim)
        for tname in TILES:
            for kind in ("forward_split", f"forward_split_pack{cell.heads_q // cell.heads_kv}"):
                if (tname, str(spec), kind) not in [(a, str(b), c) for a, b, c in work]:
                    work.append((tname, spec, kind))
    t0 = time.time()
    with futures.ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_build, *zip(*work)))
    print("precompiled", len(work), "in", round(time.time() - t0), "s", flush=True)


def main():
    precompile()
    try:
        import fa_gen.combine  # noqa: F401
        combine = "kernel"
    except ImportError:
        sys.path.insert(0, "bench")
        from torch_combine import torch_combine
        inf._combine = lambda: torch_combine
        combine = "torch"
    print("combine:", combine, flush=True)
    from fa_gen.reference import attention_reference
    timer = bd.Timer()
    copy = bd.copy_bandwidth(timer)
    print("copy GB/s", round(copy["gbps"]), flush=True)
    results = {"copy": copy, "cells": []}
    for cell in CELLS:
        spec, q, k, v = bd.seeded_decode_inputs(cell)
        ref, _ = attention_reference(q[:1], k[:1], v[:1], spec, torch.float32)
        for tname in TILES:
            _patch(tname)
            for pack in ((None,) if os.environ.get("PACKED_ONLY") else (None, False)):
                for splits in SPLITS:
                    row = dict(cell=cell.name, tile=tname, pack=pack, splits=splits)
                    try:
                        fn = lambda: inf.forward_split(spec, q, k, v, num_splits=splits, pack_gqa=pack)
                        out, lse = fn()
                        row["err"] = (out[:1].float() - ref).abs().max().item()
                        # The same bar as bench_decode's check: a wrong kernel's speed means nothing.
                        row["ok"] = row["err"] <= 0.02
                        reasons = sm80._tile_reasons(sm80.TileConfig(*TILES[tname]), spec, inf.current_arch())
                        if reasons:
                            row["refused_by_family"] = "; ".join(reasons)
                        row["ms"] = timer.median_ms(fn)
                        row["gbps"] = round(bd.gbps(cell.kv_bytes, row["ms"]))
                        saved = inf._combine
                        inf._combine = lambda: (lambda *a: None)
                        row["ms_no_combine"] = timer.median_ms(fn)
                        row["gbps_no_combine"] = round(bd.gbps(cell.kv_bytes, row["ms_no_combine"]))
                        inf._combine = saved
                    except Exception as e:
                        row["error"] = str(e)[:300]
                    results["cells"].append(row)
                    print(row, flush=True)
    json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    # Tiles are patched in, which the cache's by-target index cannot see: a dump directory turns it off.
    os.environ.setdefault("FA_GEN_DUMP_DIR", "/tmp/fa_gen_sweep_sources")
    main()
