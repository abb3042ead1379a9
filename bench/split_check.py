"""Ad hoc (before the combine kernel lands): split / packed / varlen forwards vs the float64 reference,
with a torch combine standing in for fa_gen.combine."""
import os, sys, itertools, traceback
sys.path.insert(0, os.getcwd())
import torch
import fa_gen.inference as inf
from fa_gen.check import compare
from fa_gen.spec_load import load_spec
from fa_gen.runtime import resolve_spec



specs = [resolve_spec("causal_bf16_d128"), resolve_spec("full_fp16_d64"), resolve_spec("sliding_window_bf16_d128"),
         resolve_spec("softcap"), load_spec({"name": "tl_bf16_d128", "dtype": "bf16", "head_dim": 128,
                                              "mask": {"kind": "causal", "alignment": "top_left"}})]


def _build(spec, kind):
    inf.inference_kernel(spec, inf.current_arch(), kind)


def precompile():
    from concurrent import futures
    import multiprocessing, time
    from fa_gen.families.sm80 import gqa_packable
    work = []
    for spec in specs:
        for kind in ("forward_split", "forward_varlen", "forward_varlen_split"):
            work.append((spec, kind))
            for g in (2, 4, 8):
                if kind != "forward_varlen" and gqa_packable(spec):
                    work.append((spec, f"{kind}_pack{g}"))
    t0 = time.time()
    with futures.ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_build, *zip(*work)))
    print("precompiled", len(work), "in", round(time.time() - t0), "s", flush=True)


def main():
    sys.path.insert(0, 'bench')
    from torch_combine import torch_combine
    try:
        import fa_gen.combine  # noqa: F401
    except ImportError:
        inf._combine = lambda: torch_combine
    precompile()
    fails = 0
    g = torch.Generator(device="cuda").manual_seed(1)
    for spec in specs:
        dt = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
        inputs = {"softcap": 20.0} if spec.name == "softcap" else None
        for (b, sq, sk, hkv, grp), splits, pack in itertools.product(
                [(3, 1, 1000, 2, 4), (2, 37, 777, 1, 8), (1, 5, 3, 3, 2), (2, 100, 3000, 2, 2)], [None, 1, 3], [None, False, True]):
            try:
                q = torch.randn(b, sq, hkv * grp, spec.head_dim_qk, generator=g, device="cuda").to(dt)
                k = torch.randn(b, sk, hkv, spec.head_dim_qk, generator=g, device="cuda").to(dt)
                v = torch.randn(b, sk, hkv, spec.head_dim_v, generator=g, device="cuda").to(dt)
                out, lse = inf.forward_split(spec, q, k, v, num_splits=splits, inputs=inputs, pack_gqa=pack)
                r = compare(spec, q, k, v, out, lse, inputs)
                if not r.ok:
                    fails += 1
                print("split", spec.name, (b, sq, sk, hkv, grp), splits, pack, r, flush=True)
                # the same batch as varlen (equal lengths) and with mixed lengths
                lens = [(max(sq - i, 0), max(sk - 7 * i, 0)) for i in range(b)]
                qv = torch.cat([q[i, :lq] for i, (lq, _) in enumerate(lens)])
                kv_ = torch.cat([k[i, :lk] for i, (_, lk) in enumerate(lens)])
                vv = torch.cat([v[i, :lk] for i, (_, lk) in enumerate(lens)])
                cq = torch.tensor([0] + list(itertools.accumulate(l for l, _ in lens)), dtype=torch.int32, device="cuda")
                ck = torch.tensor([0] + list(itertools.accumulate(l for _, l in lens)), dtype=torch.int32, device="cuda")
                o2, l2 = inf.forward_varlen(spec, qv, kv_, vv, cq, ck, max(l for l, _ in lens), max(l for _, l in lens),
                                            num_splits=splits, inputs=inputs, pack_gqa=pack)
                for i, (lq, lk) in enumerate(lens):
                    if lq == 0:
                        continue
                    sl = slice(cq[i].item(), cq[i + 1].item())
                    r = compare(spec, q[i:i + 1, :lq], k[i:i + 1, :lk], v[i:i + 1, :lk], o2[sl].unsqueeze(0),
                                l2[:, sl].unsqueeze(0), inputs)
                    if not r.ok:
                        fails += 1
                        print("varlen FAIL", spec.name, i, lens, splits, pack, r, flush=True)
            except Exception:
                fails += 1
                print("ERROR", spec.name, (b, sq, sk, hkv, grp), splits, pack, traceback.format_exc()[-1500:], flush=True)
    print("FAILURES", fails)


if __name__ == '__main__':
    main()
