"""Backward-pass benchmark on a Hopper GPU: fa_gen's sm90 and sm80 backward kernels beside
FlashAttention-4 and PyTorch SDPA (cuDNN, flash), same shapes for all.

    python bench/bench_backward_sm90.py --commit abc1234 --out bench/results
    python bench/bench_backward_sm90.py --check      # quick exactness smoke test first

Shapes follow issue 5: bf16, batch * seqlen = 16k, 16 heads, head dim 128 (others with
--head-dims). Only the backward is timed: the forward runs once per case for out and LSE.
TFLOP/s = 2.5 * forward FLOPs / time (forward FLOPs = 4 * b * h * s^2 * d, halved for causal).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_gen  # noqa: E402
from fa_gen.backward import build_backward  # noqa: E402
from fa_gen.runtime import build  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402

HEADS = 16
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOKENS = 16 * 1024


def spec_for(head_dim: int, causal: bool, dtype: str = "bf16"):
    return load_spec({"name": f"bench_{dtype}_d{head_dim}_{'causal' if causal else 'full'}", "dtype": dtype,
                      "head_dim": head_dim, "mask": "causal" if causal else "none"})


def time_ms(fn, calls: int = 10, repeats: int = 7) -> float:
    """Per-call time of `calls` calls queued back to back between two events (median of
    `repeats`): the host runs ahead as in training, so per-call host overhead (argument checks,
    allocations, launches) hides behind the previous call, as in bench/bench_forward.py."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def fa_gen_backward(family: str):
    def make(spec, q, k, v, dout):
        forward = build(spec, family=family)
        backward = build_backward(spec, family=family)
        out, lse = forward.forward(q, k, v)
        return lambda: backward(dout, q, k, v, out, lse)
    return make


def fa4_backward(spec, q, k, v, dout):
    from flash_attn.cute import interface

    causal = spec.window_right is not None
    out, lse = interface._flash_attn_fwd(q, k, v, causal=causal, return_lse=True)[:2]
    return lambda: interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)


def sdpa_backward(backend_name: str):
    def make(spec, q, k, v, dout):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        causal = spec.window_right is not None
        leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        grad = dout.transpose(1, 2)

        def run():
            with sdpa_kernel(backend):
                torch.autograd.grad(out, leaves, grad, retain_graph=True)
        return run
    return make


def fa_gen_sm90_patched(patch):
    """The sm90 backward built while `patch()` is in effect (it changes something in
    fa_gen.families.sm90_backward and returns a function that undoes it): A/B comparisons in one
    run, without a knob in the library. Built kernels are forgotten before and after."""
    def make(spec, q, k, v, dout):
        from fa_gen import backward as backward_mod

        undo = patch()
        backward_mod._BACKWARDS.clear()
        # The patch changes renders that the cache's by-target index cannot see: a dump
        # directory turns the index off while the patched kernel is built.
        dump = os.environ.get("FA_GEN_DUMP_DIR")
        os.environ["FA_GEN_DUMP_DIR"] = dump or "/tmp/fa_gen_patched_sources"
        try:
            return fa_gen_backward("sm90")(spec, q, k, v, dout)
        finally:
            undo()
            backward_mod._BACKWARDS.clear()
            if dump is None:
                del os.environ["FA_GEN_DUMP_DIR"]
    return make


def fa_gen_sm90_variant(overrides: dict):
    """The sm90 backward with some of its render-time choices (kind_context keys) overridden."""
    def patch():
        from fa_gen.families import sm90_backward

        original = sm90_backward.kind_context
        sm90_backward.kind_context = lambda s, a: {**original(s, a), **overrides}
        return lambda: setattr(sm90_backward, "kind_context", original)
    return fa_gen_sm90_patched(patch)


def fa_gen_sm90_tiles(transform):
    """The sm90 backward with its tile lists replaced by `transform(dims, configs)` for every
    (qk, v) head-dim pair of fa_gen.families.sm90_backward._TILES."""
    def patch():
        from fa_gen.families import sm90_backward

        saved = dict(sm90_backward._TILES)
        sm90_backward._TILES.update({dims: transform(dims, cfgs) for dims, cfgs in saved.items()})

        def undo():
            sm90_backward._TILES.clear()
            sm90_backward._TILES.update(saved)
        return undo
    return fa_gen_sm90_patched(patch)


def parse_variant(text: str) -> tuple[str, dict]:
    """'name:key=value,key=value' (values are Python literals) -> (name, overrides)."""
    import ast

    name, _, assignments = text.partition(":")
    pairs = (item.split("=", 1) for item in assignments.split(",") if item)
    return name, {key: ast.literal_eval(value) for key, value in pairs}


IMPLEMENTATIONS = {
    "fa_gen_sm90": fa_gen_backward("sm90"),
    "fa_gen_sm80": fa_gen_backward("sm80"),
    "fa4": fa4_backward,
    "sdpa_cudnn": sdpa_backward("CUDNN_ATTENTION"),
    "sdpa_flash": sdpa_backward("FLASH_ATTENTION"),
}


def bench(args) -> list[dict]:
    rows = []
    for head_dim in args.head_dims:
        for causal in (False, True):
            spec = spec_for(head_dim, causal, args.dtype)
            for seqlen in args.seqlens:
                batch = max(TOKENS // seqlen, 1)
                gen = torch.Generator(device="cuda").manual_seed(seqlen)
                q, k, v, dout = (torch.randn(batch, seqlen, HEADS, head_dim, device="cuda", generator=gen,
                                             dtype=TORCH_DTYPES[args.dtype]) for _ in range(4))
                flops = 2.5 * 4 * batch * HEADS * seqlen * seqlen * head_dim / (2 if causal else 1)
                row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": HEADS,
                       "dtype": args.dtype}
                for name in args.impls:
                    try:
                        ms = time_ms(IMPLEMENTATIONS[name](spec, q, k, v, dout))
                        row[name] = round(flops / ms / 1e9, 1)
                    except Exception as exc:  # an anchor missing on this machine is a row entry, not a crash
                        row[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def kernel_times(run, calls: int = 5) -> dict:
    """Device microseconds per call of each kernel `run` launches (`calls` calls under torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    return {event.key[:80]: round(event.device_time_total / calls, 1) for event in prof.key_averages()
            if event.device_time_total > 0}


def profile(args) -> None:
    """Per-kernel device time of each implementation's backward (pre-pass, main kernel, post-pass)."""
    for head_dim in args.head_dims:
        for causal in (False, True):
            seqlen = args.seqlens[0]
            batch = max(TOKENS // seqlen, 1)
            q, k, v, dout = (torch.randn(batch, seqlen, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
            for name in args.impls:
                run = IMPLEMENTATIONS[name](spec_for(head_dim, causal), q, k, v, dout)
                print(f"{name} d{head_dim} {'causal' if causal else 'full'} s={seqlen}:")
                for kernel, us in kernel_times(run).items():
                    print(f"  {us:9.1f} us  {kernel[:70]}")


def check(args) -> bool:
    """fa_gen's sm90 backward against the sm80 one and float64 autograd on a few shapes."""
    from fa_gen.check import Shape, random_inputs
    from fa_gen.reference import attention_reference

    ok = True
    for head_dim in args.head_dims:
        for mask in ("none", "causal", {"kind": "sliding_window", "left": 100, "right": 7}):
            spec = load_spec({"name": f"chk_d{head_dim}_{mask if isinstance(mask, str) else 'window'}",
                              "dtype": "bf16", "head_dim": head_dim, "mask": mask})
            forward, backward = build(spec, family="sm90"), build_backward(spec, family="sm90")
            for shape in (Shape(1, 128, 128, 2, 2), Shape(2, 300, 517, 6, 2), Shape(1, 1000, 257, 8, 1)):
                gen = torch.Generator(device="cuda").manual_seed(1)
                q, k, v = random_inputs(spec, shape, torch.bfloat16, "cuda", gen)
                dout = torch.randn(*q.shape, generator=gen, device="cuda").to(q.dtype)
                out, lse = forward.forward(q, k, v)
                got = backward(dout, q, k, v, out, lse)
                leaves = [t.double().requires_grad_() for t in (q, k, v)]
                attention_reference(*leaves, spec)[0].backward(dout.double())
                errs = [float((g.double() - l.grad).abs().max()) for g, l in zip(got, leaves)]
                scale = [float(l.grad.abs().max()) for l in leaves]
                good = all(e <= 0.02 * max(s, 1e-3) for e, s in zip(errs, scale)) and all(
                    bool(torch.isfinite(g).all()) for g in got)
                ok &= good
                print(f"{'ok  ' if good else 'FAIL'} {spec.name} {shape}: max err dq/dk/dv "
                      + " ".join(f"{e:.3g}/{s:.3g}" for e, s in zip(errs, scale)), flush=True)
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only the exactness smoke test")
    parser.add_argument("--profile", action="store_true", help="per-kernel times of the sm90 backward")
    parser.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[128])
    parser.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192, 16384])
    parser.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLEMENTATIONS))
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bf16", help="of the timed runs")
    parser.add_argument("--commit", default="dev")
    parser.add_argument("--out", default=None, help="directory for <date>-<commit>-sm90-bwd.json")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="also time the sm90 backward with these kind_context overrides")
    args = parser.parse_args(argv)
    for text in args.variant:
        name, overrides = parse_variant(text)
        IMPLEMENTATIONS[f"fa_gen_sm90_{name}"] = fa_gen_sm90_variant(overrides)
        args.impls.append(f"fa_gen_sm90_{name}")
    if args.check:
        sys.exit(0 if check(args) else 1)
    if args.profile:
        return profile(args)
    rows = bench(args)
    if args.out:
        date = datetime.date.today().isoformat()
        suffix = "" if args.dtype == "bf16" else f"-{args.dtype}"
        path = os.path.join(args.out, f"{date}-{args.commit}-sm90-bwd{suffix}.json")
        meta = {"commit": args.commit, "date": date, "device": torch.cuda.get_device_name(),
                "fa_gen": fa_gen.__version__, "metric": "backward TFLOP/s = 2.5 * forward FLOPs / time"}
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
