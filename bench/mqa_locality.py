"""Ad hoc (python bench/mqa_locality.py): does a decode cell's speed depend on whether the CTAs
running together read neighbouring memory? The MQA cell (b32 sk16k, 32 query heads on one KV
head) reads 0.83-0.88 of the copy bandwidth; its 128 split CTAs each stream a private 1 MB range
of K and of V. The GQA cells, at 0.95-1.00, have the CTAs of one split's 8 KV heads reading
interleaved 256-byte rows of the same region. Pages of one key tile (64 rows) let the same
kernel read the same logical K/V from different physical orders, without a template change:

  sequential   page p of sequence b at b * P + p (the contiguous layout, through the page table)
  interleaved  the S splits of a sequence read neighbouring pages: its page s * P/S + j at
               b * P + j * S + s (S = the split count)
  across       one step of every CTA in one region: page (b, s, j) at (j * B + b) * S + s
  random       a random permutation of all pages (bench_paged's layout)

GB/s of K+V, L2 flushed before each call (bench_decode.Timer); also the contiguous split kernel.
Writes $OUT/mqa_locality.json when OUT is set."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
import bench_decode as bd
import fa_gen
import fa_gen.inference as inf
from fa_gen.runtime import resolve_spec

PAGE = 64
CELLS = [(32, 16384, 32, 1, 4), (1, 131072, 32, 8, 16), (8, 32768, 32, 8, 4)]  # b, sk, hq, hkv, splits


def layouts(b, pages, splits, device):
    per = pages // splits
    seq = torch.arange(b * pages, device=device).view(b, pages)
    bi = torch.arange(b, device=device).view(b, 1, 1)
    si = torch.arange(splits, device=device).view(1, splits, 1)
    ji = torch.arange(per, device=device).view(1, 1, per)
    inter = (bi * pages + ji * splits + si).reshape(b, pages)
    across = ((ji * b + bi) * splits + si).reshape(b, pages)
    rand = torch.randperm(b * pages, device=device).view(b, pages)
    return {"sequential": seq, "interleaved": inter, "across": across, "random": rand}


def main():
    timer = bd.Timer()
    copy = bd.copy_bandwidth(timer)
    print("copy GB/s", round(copy["gbps"]), flush=True)
    spec = resolve_spec(bd.fa_gen_spec(False, "bf16", 128))
    rows = []
    for b, sk, hq, hkv, splits in CELLS:
        q = torch.randn(b, 1, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * k.numel() * 2
        seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        ref = inf.forward_split(spec, q, k, v, num_splits=splits)[0].float()
        for name, fn in [("contiguous_split", lambda: inf.forward_split(spec, q, k, v, num_splits=splits))]:
            ms = timer.median_ms(fn)
            rows.append({"cell": f"b{b}_sk{sk}_h{hq}/{hkv}", "layout": name, "splits": splits, "ms": ms,
                         "gbps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / copy["gbps"]})
            print(rows[-1], flush=True)
        pages = sk // PAGE
        for name, table in layouts(b, pages, splits, "cuda").items():
            flat = table.reshape(-1)
            kp = torch.empty((b * pages, PAGE, hkv, 128), dtype=k.dtype, device="cuda")
            vp = torch.empty_like(kp)
            kp[flat] = k.reshape(b * pages, PAGE, hkv, 128)
            vp[flat] = v.reshape(b * pages, PAGE, hkv, 128)
            pt = table.to(torch.int32).contiguous()
            fn = lambda: fa_gen.attention_with_kvcache(q, kp, vp, seqlens, spec, page_table=pt, num_splits=splits)
            err = (fn()[0].float() - ref).abs().max().item()
            ms = timer.median_ms(fn)
            rows.append({"cell": f"b{b}_sk{sk}_h{hq}/{hkv}", "layout": name, "splits": splits, "ms": ms,
                         "gbps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / copy["gbps"], "err": err})
            print(rows[-1], flush=True)
            del kp, vp
        del q, k, v
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "mqa_locality.json"), "w") as f:
            json.dump({"copy": copy, "rows": rows, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
