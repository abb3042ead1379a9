"""Host time per forward call, by layer (fa_gen vs SDPA and FA4): small shapes, so the GPU keeps up
and wall time / calls is the host's cost. Usage: python bench/fwd_host_overhead.py [--cprofile]
(--cprofile: fa_gen.attention's calls under cProfile, the top functions by cumulative time)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fa_gen  # noqa: E402
from bwd_host_overhead import per_call_us, print_profile  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402


def main():
    spec = load_spec({"name": "host_full_bf16_d128", "dtype": "bf16", "head_dim": 128, "mask": "none"})
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    kernel = fa_gen.build(spec)
    rows = {
        "fa_gen.attention": lambda: fa_gen.attention(q, k, v, spec),
        "fa_gen.attention, grad": lambda: fa_gen.attention(qg, kg, vg, spec),
        "build(spec)(q, k, v)": lambda: kernel(q, k, v),
        "  _check": lambda: kernel._check(q, k, v),
        "  out, lse empties": lambda: (q.new_empty((1, 128, 2, 128)), q.new_empty((1, 2, 128), dtype=torch.float32)),
    }
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    rows["sdpa (default backend)"] = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
    try:
        from flash_attn.cute import flash_attn_func

        rows["fa4 flash_attn_func"] = lambda: flash_attn_func(q, k, v)
        rows["fa4 flash_attn_func, grad"] = lambda: flash_attn_func(qg, kg, vg)
    except ImportError:
        pass
    for name, fn in rows.items():
        print(f"{name:30s} {per_call_us(fn):8.1f} us/call host")
    if "--cprofile" in sys.argv:
        print_profile(rows["fa_gen.attention, grad"], 30)


if __name__ == "__main__":
    main()
