"""Where a backward call's host time goes on autograd's device thread, piece by piece.

    python bench/bwd_host_threads.py

autograd runs the backward of CUDA tensors on its device thread; bench/bwd_host_overhead.py found
fa_gen's autograd.grad 86 us slower there than on the calling thread (FA4: 42 us). Each row is
an autograd.Function shaped like fa_gen's (two outputs, lse non-differentiable, five saved
tensors) whose backward does one more piece of fa_gen's work than the row above, so the
difference between rows is that piece's cost on each thread. Columns: host us a call with the
GPU kept busy (wall time of 2,000 calls), on the device thread and on the calling thread; and
the latency of one call from an idle GPU (CUDA events around it, synchronised each time), which
is what a per-call benchmark adds to the kernels' time.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bwd_host_overhead import fa4_grad, per_call_us as host_us  # noqa: E402
from bench_ring import timed  # noqa: E402
from fa_gen.api import attention  # noqa: E402
from fa_gen.backward import _workspace, build_backward  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402


def latency_us(fn, calls=300):
    """Median us of one call from an idle GPU, CUDA events around it."""
    return timed(fn, calls, across_ranks=False) * 1e3


def staged(bwd, stage: int):
    """An autograd.Function with fa_gen's shape whose backward does the first `stage` pieces:
    1 the saved tensors and dout.contiguous(), 2 build_backward's lookup, 3 dq/dk/dv allocated,
    4 the workspace, 5 the kernels launched."""
    spec = bwd.spec

    class Staged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = q.clone(), torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dout = dout.contiguous()
            if stage >= 2:
                kernel = build_backward(spec)
            if stage < 3:
                return dout, dout, dout
            dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
            if stage >= 4:
                workspace = _workspace(q, 128)
            if stage >= 5:
                kernel._function(q, k, v, out, dout, lse, dq, dk, dv, *workspace, 0)
            return dq, dk, dv
    return Staged


def main():
    spec = load_spec({"name": "host_full_bf16_d128", "dtype": "bf16", "head_dim": 128, "mask": "none"})
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bwd = build_backward(spec)
    rows = {}
    names = {1: "saved + dout", 2: "+ build_backward", 3: "+ dq/dk/dv", 4: "+ workspace", 5: "+ launch"}
    for stage, name in names.items():
        out, _ = staged(bwd, stage).apply(q, k, v)
        dout = torch.randn_like(out)
        rows[f"staged {stage}: {name}"] = (lambda o, d: lambda: torch.autograd.grad(o, (q, k, v), d, retain_graph=True))(out, dout)
    out, _ = attention(q, k, v, spec)  # the spec above returns LSE (the default)
    dout = torch.randn_like(out)
    rows["fa_gen"] = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    fa4 = fa4_grad(q, k, v, dout)
    if fa4 is not None:
        rows["fa4"] = fa4
    print(f"{'':34s} {'device thread':>14s} {'calling thread':>15s} {'latency (dev.)':>15s} {'latency (call.)':>16s}")
    for name, fn in rows.items():
        multi, multi_latency = host_us(fn), latency_us(fn)
        with torch.autograd.set_multithreading_enabled(False):
            single, single_latency = host_us(fn), latency_us(fn)
        print(f"{name:34s} {multi:14.1f} {single:15.1f} {multi_latency:15.1f} {single_latency:16.1f}", flush=True)


if __name__ == "__main__":
    main()
