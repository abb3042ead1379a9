"""Ad hoc: how fast each kernel design streams a decode step's K/V, at one query row per KV head
(no GQA packing needed): the sm80 split kind (cp.async, every warp copies and computes), the sm90
whole-range varlen kind (TMA from a producer warp, wgmma consumers) and FlashAttention-4, on the
same tensors, beside the packed GQA decode of bench_decode. GB/s of K+V read, L2 flushed by a read.

    python bench/decode_stream_probe.py      # prints a table; JSON to $OUT (or /tmp)
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch  # noqa: E402

import bench_decode as bd  # noqa: E402
import fa_gen.inference as inf  # noqa: E402

SHAPES = ((64, 8192, 8, 8), (64, 8192, 32, 8), (8, 32768, 8, 8))  # batch, seqlen_k, heads_q, heads_kv


def paths(spec, q, k, v):
    b, sk, hkv, d = k.shape
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    cu_k = cu_q * sk
    qv, kv, vv = q.reshape(b, q.shape[2], d), k.reshape(b * sk, hkv, d), v.reshape(b * sk, hkv, d)
    out = {
        "split_64x64": lambda: inf.forward_split(spec, q, k, v, num_splits=1),
        "sm90_whole_tma": lambda: inf.forward_varlen(spec, qv, kv, vv, cu_q, cu_k, 1, sk, num_splits=1),
    }
    from flash_attn.cute import flash_attn_func
    out["fa4"] = lambda: flash_attn_func(q, k, v)
    return out


def main():
    timer = bd.Timer()
    copy = bd.copy_bandwidth(timer)
    rows = []
    for batch, sk, hq, hkv in SHAPES:
        cell = bd.DecodeCell(f"b{batch}_sk{sk // 1024}k_h{hq}/{hkv}", batch, sk, hq, hkv, 128, "bf16")
        spec, q, k, v = bd.seeded_decode_inputs(cell)
        ref = None
        for name, fn in paths(spec, q, k, v).items():
            if name == "sm90_whole_tma" and hq != hkv:
                continue
            inf.WIDE_SPLITS = False
            result = fn()
            o = (result[0] if isinstance(result, tuple) else result).reshape(batch, hq, -1).float()
            ref = o if ref is None else ref
            err = (o - ref).abs().max().item()
            ms = min(timer.median_ms(fn) for _ in range(3))
            rows.append(dict(cell=cell.name, path=name, ms=ms, gbps=round(bd.gbps(cell.kv_bytes, ms)), err=err))
            print(rows[-1], flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "decode_stream_probe.json")
    with open(path, "w") as f:
        json.dump({"copy": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
