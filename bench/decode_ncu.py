"""Decode cells under ncu (python bench/decode_ncu.py --ncu [--cells ...] [--impls ...]): per kernel
its time, DRAM bytes read and written, DRAM throughput, grid and occupancy, and how evenly the
SMs were busy (sm__cycles_active min / avg / max against the elapsed cycles: a long tail or a
slow ramp shows as avg well under elapsed). ncu flushes the caches before each kernel. Without
--ncu the script is the profiled program: each (cell, impl) is called 3 times, then once between
cudaProfilerStart and cudaProfilerStop."""
import argparse, csv, io, os, subprocess, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))

METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__grid_size", "launch__block_size",
           "launch__occupancy_limit_shared_mem", "launch__registers_per_thread",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "sm__cycles_active.min", "sm__cycles_active.avg",
           "sm__cycles_active.max", "sm__cycles_elapsed.max", "smsp__inst_executed.sum",
           "lts__t_sectors_srcunit_tex_op_read.sum")


def profiled(cells, impls):
    import torch
    import bench_decode as bd
    by_name = {c.name: c for c in bd.DECODE_CELLS}
    for name in cells:
        cell = by_name[name]
        dtype = bd.TORCH_DTYPES[cell.dtype]
        draw = lambda s, h: torch.randn(cell.batch, s, h, cell.head_dim, device="cuda", dtype=dtype)
        q, k, v = draw(1, cell.heads_q), draw(cell.seqlen_k, cell.heads_kv), draw(cell.seqlen_k, cell.heads_kv)
        for impl in impls:
            fn = bd.DECODE_IMPLS[impl](cell, q, k, v)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{name}|{impl}")
            torch.cuda.profiler.start()
            fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()
        del q, k, v
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--cells", default="b64_sk8k_h32/8,b128_sk2k_h64/8")
    p.add_argument("--impls", default="fa_gen_attention,fa4,sdpa_cudnn")
    a = p.parse_args()
    if not a.ncu:
        return profiled(a.cells.split(","), a.impls.split(","))
    cmd = ["ncu", "--profile-from-start", "off", "--nvtx", "--csv", "--page", "raw", "--metrics", ",".join(METRICS),
           sys.executable, __file__, "--cells", a.cells, "--impls", a.impls]
    r = subprocess.run(cmd, capture_output=True, text=True)
    text = r.stdout[r.stdout.find('"ID"'):]
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        print(r.stdout[-3000:], r.stderr[-3000:])
        return
    ranges = [k for k in rows[0] if "nvtx" in k.lower() or "range" in k.lower()]
    for row in rows[1:]:  # the first row holds units
        nv = " ".join(str(row[k]) for k in ranges if row.get(k))
        out = {m.split(".")[0].replace("__", ":") + ("." + m.split(".")[-1] if m.count(".") else ""): row.get(m) for m in METRICS}
        print(row.get("Kernel Name", "")[:60], nv, out, flush=True)


if __name__ == "__main__":
    main()
