"""Host time per backward call, by layer (fa_gen vs SDPA flash): small shapes, so the GPU keeps up
and wall time / calls is the host's cost. Usage: python bench/bwd_host_overhead.py [--cprofile]
(--cprofile: then fa_gen's autograd.grad under cProfile, the top functions by cumulative time)."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fa_gen.api import attention  # noqa: E402
from fa_gen.autograd import spec_key  # noqa: E402
from fa_gen.backward import _workspace, build_backward  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402


def per_call_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def main():
    spec = load_spec({"name": "host_full_bf16_d128", "dtype": "bf16", "head_dim": 128, "mask": "none"})
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = attention(q, k, v, spec) if spec.return_lse else (attention(q, k, v, spec), None)
    dout = torch.randn_like(out)
    key = spec_key(spec)
    bwd = build_backward(spec)
    with torch.no_grad():
        o2, lse2 = torch.ops.fa_gen.attention_forward(q, k, v, key, False, [], [])
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    ws = _workspace(qd, 128)
    dq, dk, dv = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)
    rows = {
        "fa_gen autograd.grad": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "fa_gen op .default": lambda: torch.ops.fa_gen.attention_backward.default(dout, qd, kd, vd, o2, lse2, key, False, [], []),
        "fa_gen Backward()": lambda: bwd(dout, qd, kd, vd, o2, lse2),
        "  _check": lambda: bwd._check(dout, qd, kd, vd, o2, lse2),
        "  _workspace": lambda: _workspace(qd, 128),
        "  3x empty": lambda: tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (qd, kd, vd)),
        "  compiled fn": lambda: bwd._function(qd, kd, vd, o2, dout, lse2, dq, dk, dv, *ws, 0),
    }
    qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        so = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
    sdo = torch.randn_like(so)
    rows["sdpa_flash autograd.grad"] = lambda: torch.autograd.grad(so, (qs, ks, vs), sdo, retain_graph=True)

    class Passthrough(torch.autograd.Function):
        """The engine's own cost for a Python Function: a backward that launches nothing."""

        @staticmethod
        def forward(ctx, a, b, c):
            return a.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad, grad, grad

    po = Passthrough.apply(q, k, v)
    rows["Python Function autograd.grad"] = lambda: torch.autograd.grad(po, (q, k, v), dout, retain_graph=True)
    fa4 = fa4_grad(q, k, v, dout)
    if fa4 is not None:
        rows["fa4 autograd.grad"] = fa4
    for name, fn in rows.items():
        print(f"{name:30s} {per_call_us(fn):8.1f} us/call host")
    # The same backwards run on this thread instead of the device's autograd thread.
    with torch.autograd.set_multithreading_enabled(False):
        for name in [n for n in rows if n.endswith("autograd.grad")]:
            print(f"{name + ', one thread':42s} {per_call_us(rows[name]):8.1f} us/call host")
    if "--cprofile" in sys.argv:
        # Where fa_gen's autograd.grad spends its host time, by function (cumulative).
        # The backward on this thread (cProfile sees one thread; autograd's is the device's).
        with torch.autograd.set_multithreading_enabled(False):
            print_profile(rows["fa_gen autograd.grad"], 35)


def fa4_grad(q, k, v, dout):
    """autograd.grad through FlashAttention-4's forward of (q, k, v), or None where it is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    out = flash_attn_func(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def print_profile(fn, top: int, calls: int = 500):
    """`calls` calls of fn under cProfile; the `top` functions by cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


if __name__ == "__main__":
    main()
