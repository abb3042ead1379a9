"""Decode GB/s of fa_gen's split-KV forward per split count, beside cuDNN (SDPA) and a D2D copy, in
one process: what num_splits_for should pick per cell.

    CELLS=b1_sk128k_h32/8,b64_sk8k_h32/8_d64 SPLITS=1,2,3,4 python bench/split_sweep.py
    PAD_KEYS=0,40 CELLS=b32_sk16k_h32/1 SPLITS=4,8 python bench/split_sweep.py

PAD_KEYS: K and V are also timed in copies whose batch entries sit that many key rows further
apart (the same values, the batch stride no longer seqlen_k rows): whether the cell's speed
depends on where in memory its sequences start. Writes $OUT/split_sweep.json (or /tmp)."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import bench_decode as bd
import fa_gen.inference as inf

CELLS = [c for c in bd.DECODE_CELLS if not os.environ.get("CELLS") or c.name in os.environ["CELLS"].split(",")]
SPLITS = [int(s) for s in os.environ.get("SPLITS", "1,2,3,4,6,8,16,24,32,33,48,64,66,99").split(",")]
ROUNDS = int(os.environ.get("ROUNDS", "1"))  # every cell's impls timed again, interleaved: the noise
PAD_KEYS = [int(p) for p in os.environ.get("PAD_KEYS", "0").split(",")]


def padded(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x (batch, seqlen, heads, d) in storage with `pad` extra key rows per batch entry."""
    if pad == 0:
        return x
    store = torch.empty((x.shape[0], x.shape[1] + pad, *x.shape[2:]), dtype=x.dtype, device=x.device)
    store[:, :x.shape[1]].copy_(x)
    return store[:, :x.shape[1]]


def main():
    timer = bd.Timer()
    copy = bd.copy_bandwidth(timer)
    print("copy GB/s", round(copy["gbps"]), flush=True)
    rows = []
    for cell, pad in [(c, p) for c in CELLS for p in PAD_KEYS] * ROUNDS:
        spec, q, k, v = bd.seeded_decode_inputs(cell)
        k, v = padded(k, pad), padded(v, pad)
        cudnn = bd.sdpa("CUDNN_ATTENTION", q, k, v)
        ref = cudnn().float()
        row = {"cell": cell.name, "pad_keys": pad, "impl": "sdpa_cudnn", "ms": timer.median_ms(cudnn)}
        row["gbps"] = round(bd.gbps(cell.kv_bytes, row["ms"]))
        rows.append(row); print(row, flush=True)
        for splits in [None] + SPLITS:
            row = {"cell": cell.name, "pad_keys": pad, "impl": "fa_gen_split", "splits": splits}
            try:
                fn = lambda: inf.forward_split(spec, q, k, v, num_splits=splits)
                row["err_vs_cudnn"] = (fn()[0].float() - ref).abs().max().item()
                row["ms"] = timer.median_ms(fn)
                row["gbps"] = round(bd.gbps(cell.kv_bytes, row["ms"]))
                row["over_copy"] = round(row["gbps"] / copy["gbps"], 3)
            except Exception as exc:
                row["error"] = str(exc)[:300]
            rows.append(row); print(row, flush=True)
    out = os.path.join(os.environ.get("OUT", "/tmp"), "split_sweep.json")
    json.dump({"copy": copy, "device": torch.cuda.get_device_name(), "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
