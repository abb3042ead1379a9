"""Ad hoc (python bench/mqa_stride.py): MQA decode with K/V rows contiguous vs strided (slices of wider tensors), GB/s of useful bytes."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import bench_decode as bd
import fa_gen.inference as inf
from fa_gen.runtime import resolve_spec

timer = bd.Timer()
spec = resolve_spec(bd.fa_gen_spec(False, "bf16", 128))
b, s, hq = 32, 16384, 32
q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
useful = 2 * b * s * 128 * 2
for width, splits in [(1, 4), (2, 4), (4, 4), (8, 4), (1, 8), (2, 8), (8, 8)]:
    k = torch.randn(b, s, width, 128, device="cuda", dtype=torch.bfloat16)[:, :, :1]
    v = torch.randn(b, s, width, 128, device="cuda", dtype=torch.bfloat16)[:, :, :1]
    ms = timer.median_ms(lambda: inf.forward_split(spec, q, k, v, num_splits=splits))
    print({"kv_row_stride_bytes": width * 256, "splits": splits, "ms": round(ms, 4), "gbps": round(useful / ms / 1e6)}, flush=True)
    del k, v
