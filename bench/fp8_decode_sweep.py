"""Ad hoc: decode GB/s per split tile and split count, in one process. KV=fp8 (default): the fp8
KV cache (16-bit equivalent GB/s: the cell's bf16 K/V bytes) beside the bf16 KV-cache call on the
same cell. KV=16: the cell's own bf16 spec through fa_gen.attention (the decode table's
fa_gen_attention row) per tile, beside the shipped tile.

    TILES="64,64,4,2;32,64,2,2;16,64,1,2" SPLITS="0,2,4" python bench/fp8_decode_sweep.py
    KV=16 TILES="32,64,2,2;32,64,2,3" python bench/fp8_decode_sweep.py
    COMPILE_ONLY=1 CUTE_DSL_ARCH=sm_90a python bench/fp8_decode_sweep.py   # no GPU: compile only

SPLITS: 0 is the heuristic's count (fa_gen.inference._varlen_splits). Tiles are patched into
fa_gen.families.sm80.split_tile_config for the swept dtype's specs only, so the by-target cache
is off."""
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch  # noqa: E402

import fa_gen.families.sm80 as sm80  # noqa: E402
import fa_gen.inference as inf  # noqa: E402
from fa_gen.runtime import resolve_spec  # noqa: E402

FP8 = os.environ.get("KV", "fp8") == "fp8"
SPEC = "fp8_e4m3_d128" if FP8 else "full_bf16_d128"
TILES = {f"{t[0]}x{t[1]}w{t[2]}s{t[3]}": t for t in (tuple(map(int, x.split(","))) for x in
         os.environ.get("TILES", "64,64,4,2;32,64,2,2;16,64,1,2").split(";"))}
SPLITS = [int(x) for x in os.environ.get("SPLITS", "0").split(",")]
_default_split_tiles = sm80.split_tile_config


def _patch(tname):
    def split_tile_config(spec, arch, wide=False):
        swept = spec.is_fp8 == FP8
        return sm80.TileConfig(*TILES[tname]) if swept else _default_split_tiles(spec, arch, wide)
    sm80.split_tile_config = split_tile_config
    inf.inference_kernel.cache_clear()
    inf.kind_tiles.cache_clear()


def _build(tname, pack):
    _patch(tname)
    kind = inf.packed_kind("forward_varlen_split" if FP8 else "forward_split", pack)
    reasons = sm80._tile_reasons(sm80.TileConfig(*TILES[tname]), resolve_spec(SPEC), "sm_90a")
    if reasons:
        return tname, pack, "; ".join(reasons)
    t0 = time.time()
    inf.inference_kernel(resolve_spec(SPEC), os.environ.get("CUTE_DSL_ARCH", "sm_90a"), kind)
    return tname, pack, f"compiled in {time.time() - t0:.0f} s"


def precompile(packs):
    from concurrent import futures
    import multiprocessing
    work = [(t, p) for t in TILES for p in packs]
    with futures.ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row in pool.map(_build, *zip(*work)):
            print("build", row, flush=True)


def main():
    import bench_decode as bd
    import fa_gen
    from fa_gen.fp8 import E4M3

    cells = [c for c in bd.DECODE_CELLS if c.head_dim == 128 and c.dtype == "bf16"
             and (not os.environ.get("CELLS") or c.name in os.environ["CELLS"].split(","))]
    precompile(sorted({c.heads_q // c.heads_kv for c in cells}))
    if os.environ.get("COMPILE_ONLY"):
        return
    timer = bd.Timer()
    copy = bd.copy_bandwidth(timer)
    print("copy GB/s", round(copy["gbps"]), flush=True)
    results = {"copy": copy, "rows": []}
    for cell in cells:
        spec, q, k, v = bd.seeded_decode_inputs(cell)
        lengths = torch.full((cell.batch,), cell.seqlen_k, dtype=torch.int32, device=q.device)
        q8, k8, v8 = (x.to(E4M3) for x in (q, k, v)) if FP8 else (q, k, v)
        inf.inference_kernel.cache_clear()
        sm80.split_tile_config = _default_split_tiles
        bf16 = (lambda: fa_gen.attention_with_kvcache(q, k, v, lengths, spec)[0]) if FP8 else (  # noqa: E731
            lambda: inf.forward_split(spec, q, k, v)[0])
        want = bf16().float()
        row = dict(cell=cell.name, impl="bf16 kvcache" if FP8 else "bf16 shipped tile",
                   gbps=round(bd.gbps(cell.kv_bytes, timer.median_ms(bf16))))
        results["rows"].append(row)
        print(row, flush=True)
        for tname in TILES:
            _patch(tname)
            for splits in SPLITS:
                row = dict(cell=cell.name, impl="fp8 kvcache" if FP8 else "bf16", tile=tname, splits=splits)
                try:
                    fn = (lambda: fa_gen.attention_with_kvcache(q8, k8, v8, lengths, SPEC, num_splits=splits)[0]) if FP8 \
                        else (lambda: inf.forward_split(spec, q, k, v, num_splits=splits or None)[0])  # noqa: E731
                    err = (fn().float() - want).abs().max().item()
                    row["err_vs_bf16"] = round(err, 4)
                    row["ok"] = err == err and err < 0.15
                    row["gbps"] = round(bd.gbps(cell.kv_bytes, timer.median_ms(fn)))
                except Exception as e:  # a tile the family refuses, or a broken kernel
                    row["error"] = str(e)[:300]
                results["rows"].append(row)
                print(row, flush=True)
        del q, k, v, q8, k8, v8
        torch.cuda.empty_cache()
    json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), f"{'fp8' if FP8 else 'bf16'}_decode_sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    os.environ.setdefault("FA_GEN_DUMP_DIR", "/tmp/fa_gen_sweep_sources")
    main()
