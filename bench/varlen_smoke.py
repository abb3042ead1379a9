import torch, fa_gen
from fa_gen.inference import forward_varlen
from fa_gen.runtime import resolve_spec
from fa_gen.reference import attention_reference
torch.manual_seed(0)
worst = {}
for name in ["causal_bf16_d128", "full_fp16_d64", "sliding_window_bf16_d128", "softcap"]:
    spec = resolve_spec(name)
    dt = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    lq = [0, 1, 300, 77, 1029]; lk = [5, 1, 129, 700, 1029]
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device="cuda")
    hq, hk, d = 6, 2, spec.head_dim_qk
    q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dt); k = torch.randn(sum(lk), hk, d, device="cuda", dtype=dt); v = torch.randn_like(k)
    out, lse = forward_varlen(spec, q, k, v, cq, ck, max(lq), max(lk), num_splits=1)
    err = 0.0
    for b in range(len(lq)):
        a, e = int(cq[b]), int(cq[b+1]); ka, ke = int(ck[b]), int(ck[b+1])
        if e == a: continue
        ro, rl = attention_reference(q[a:e][None].double(), k[ka:ke][None].double(), v[ka:ke][None].double(), spec)
        err = max(err, (out[a:e].double() - ro[0]).abs().max().item())
        fin = torch.isfinite(rl[0])
        err = max(err, (lse[:, a:e].double()[fin] - rl[0][fin]).abs().max().item() if fin.any() else 0.0)
        assert torch.equal(torch.isinf(lse[:, a:e]), ~fin), (name, b, "lse -inf pattern")
    worst[name] = err
    print(name, "max err out/lse vs float64 per sequence:", f"{err:.3e}", "nan:", bool(out.isnan().any()), flush=True)
