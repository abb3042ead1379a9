"""Every kernel kind once, at odd shapes, for compute-sanitizer (issue: hardening).

    python bench/sanitize.py --list                         # the cases
    python bench/sanitize.py [CASE ...]                     # run them (and check the results)
    compute-sanitizer --tool memcheck python bench/sanitize.py [CASE ...]
    python bench/sanitize.py --tools [CASE ...]             # every tool in turn: one summary line each

Each case builds its inputs, launches its kernel(s) once and checks the result against the
float64 reference (a wrong answer fails the case, sanitizer or not). Kernels are compiled before
the sanitized run (--tools runs the cases once unsanitized first; a warm FA_GEN_CACHE_DIR does the
same): compute-sanitizer slows the JIT as much as the kernels. Cases: the fixed-length forward (and its short-sequence kind), the backward,
varlen forward and backward, split-KV + combine (GQA-packed), the paged KV-cache call with an
append, expression specs with tensor inputs (ALiBi slopes, sink logits), a padded head dim, and
the dropout forward and backward, MLA decode (Hopper; contiguous and paged, NaN past each sequence),
the fp8 forward (Hopper), the ring's shifted forward and backward, and the sm80 family on this GPU.
"""

from __future__ import annotations

import argparse
import re
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fa_gen  # noqa: E402
from fa_gen.check import compare  # noqa: E402
from fa_gen.runtime import resolve_spec  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def _randn(*shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


def _dtype(spec) -> torch.dtype:
    return torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16


def fixed_forward(spec="causal_bf16_d128", b=2, sq=333, sk=517, hq=6, hkv=2):
    spec = resolve_spec(spec)
    d, dv, dt = spec.head_dim_qk, spec.head_dim_v, _dtype(spec)
    q, k, v = _randn(b, sq, hq, d, dtype=dt, seed=1), _randn(b, sk, hkv, d, dtype=dt, seed=2), \
        _randn(b, sk, hkv, dv, dtype=dt, seed=3)
    out, lse = fa_gen.attention(q, k, v, spec)
    return compare(spec, q, k, v, out, lse).ok


def backward(spec="causal_bf16_d128"):
    spec = resolve_spec(spec)
    q, k, v = (_randn(2, 211, 4, d, dtype=_dtype(spec), seed=i).requires_grad_()
               for i, d in enumerate((spec.head_dim_qk, spec.head_dim_qk, spec.head_dim_v)))
    out, _ = fa_gen.attention(q, k, v, spec)
    out.float().square().sum().backward()
    return all(torch.isfinite(t.grad).all() for t in (q, k, v))


def varlen(spec="causal_bf16_d128", grad=True):
    spec = resolve_spec(spec)
    lengths = [(37, 120), (0, 5), (200, 90), (1, 1)]
    cq = torch.tensor([0] + [sum(a for a, _ in lengths[:i + 1]) for i in range(4)], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + [sum(b for _, b in lengths[:i + 1]) for i in range(4)], dtype=torch.int32, device="cuda")
    q = _randn(int(cq[-1]), 4, spec.head_dim_qk, seed=4).requires_grad_(grad)
    k = _randn(int(ck[-1]), 2, spec.head_dim_qk, seed=5).requires_grad_(grad)
    v = _randn(int(ck[-1]), 2, spec.head_dim_v, seed=6).requires_grad_(grad)
    out, lse = fa_gen.attention_varlen(q, k, v, cq, ck, 200, 120, spec)
    ok = True
    for i, (sq, sk) in enumerate(lengths):
        if sq:
            rows, keys = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
            ok &= compare(spec, q.detach()[rows][None], k.detach()[keys][None], v.detach()[keys][None],
                          out.detach()[rows][None], lse[:, rows][None]).ok
    if grad:
        out.float().square().sum().backward()
    return ok


def split_decode(spec="full_bf16_d128"):
    from fa_gen.inference import forward_split

    spec = resolve_spec(spec)
    q, k, v = _randn(3, 1, 8, 128, seed=7), _randn(3, 3001, 2, 128, seed=8), _randn(3, 3001, 2, 128, seed=9)
    out, lse = forward_split(spec, q, k, v, num_splits=7, pack_gqa=True)
    return compare(spec, q, k, v, out, lse).ok


def paged_append(spec="causal_bf16_d128"):
    spec = resolve_spec(spec)
    page, pages, batch = 16, 40, 3
    k_cache, v_cache = _randn(pages, page, 2, 128, seed=10), _randn(pages, page, 2, 128, seed=11)
    table = torch.randperm(pages, device="cuda")[:batch * 12].view(batch, 12).to(torch.int32)
    lengths = torch.tensor([0, 17, 170], dtype=torch.int32, device="cuda")
    q, k_new, v_new = _randn(batch, 2, 8, 128, seed=12), _randn(batch, 2, 2, 128, seed=13), _randn(batch, 2, 2, 128, seed=14)
    out, lse = fa_gen.attention_with_kvcache(q, k_cache, v_cache, lengths, spec, k_new=k_new, v_new=v_new,
                                             page_table=table)
    return bool(torch.isfinite(out).all())


def rotary_append(interleaved=False):
    """The append kernel with rotary tables (a rotary_dim below the head dim, positions past the
    tables' end clamped) and a left-padded contiguous cache."""
    spec = resolve_spec("causal_bf16_d128")
    batch = 3
    k_cache, v_cache = _randn(batch, 300, 2, 128, seed=20), _randn(batch, 300, 2, 128, seed=21)
    lengths = torch.tensor([0, 17, 250], dtype=torch.int32, device="cuda")
    q, k_new, v_new = _randn(batch, 2, 8, 128, seed=22), _randn(batch, 2, 2, 128, seed=23), _randn(batch, 2, 2, 128, seed=24)
    angles = torch.rand(200, 32, device="cuda") * 6.28  # rotary_dim 64; the last sequence's positions pass row 199
    cos, sin = torch.cos(angles).to(q.dtype), torch.sin(angles).to(q.dtype)
    out, lse = fa_gen.attention_with_kvcache(q, k_cache, v_cache, lengths, spec, k_new=k_new, v_new=v_new,
                                             rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                                             cache_leftpad=torch.tensor([0, 5, 100], dtype=torch.int32, device="cuda"))
    return bool(torch.isfinite(out).all())


def expression(spec="alibi"):
    spec = resolve_spec(spec)
    heads = 4
    inputs = {d.name: (torch.rand(heads, device="cuda") if not d.is_scalar else 8.0) for d in spec.inputs}
    d, dv = spec.head_dim_qk, spec.head_dim_v
    q, k, v = _randn(1, 157, heads, d, seed=15), _randn(1, 211, heads, d, seed=16), _randn(1, 211, heads, dv, seed=17)
    out, lse = fa_gen.attention(q, k, v, spec, inputs=inputs or None)
    return compare(spec, q, k, v, out, lse, inputs or None).ok


def padded_head_dim():
    spec = load_spec({"name": "sanitize_q80", "dtype": "bf16", "head_dim": 80, "mask": "causal"})
    return fixed_forward(spec) and backward(spec)


def dropout():
    from fa_gen.dropout import backward_dropout, forward_dropout

    spec = resolve_spec("causal_bf16_d128")
    q, k, v = _randn(2, 199, 4, 128, seed=18), _randn(2, 233, 2, 128, seed=19), _randn(2, 233, 2, 128, seed=20)
    out, lse = forward_dropout(spec, q, k, v, 0.2, 7, 0)
    grads = backward_dropout(spec, torch.ones_like(out), q, k, v, out, lse, 0.2, 7, 0)
    return all(torch.isfinite(t).all() for t in (out, *grads))


def mla():
    """MLA decode (Hopper), contiguous and paged, 3 splits, the cache NaN past each sequence."""
    from fa_gen.mla import mla_decode, mla_reference

    if torch.cuda.get_device_capability() != (9, 0):
        return True  # the kernel is Hopper's alone
    spec = load_spec({"name": "sanitize_mla", "dtype": "bf16", "head_dim": {"qk": 576, "v": 512}, "mask": "causal",
                      "softmax_scale": 192 ** -0.5})
    lengths = [0, 1, 130]
    q = _randn(3, 2, 7, 576, seed=21)
    cache = torch.full((3, 192, 1, 576), math.nan, dtype=torch.bfloat16, device="cuda")
    pool = torch.full((10, 64, 1, 576), math.nan, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(10, device="cuda")[:9].view(3, 3).to(torch.int32)
    for b, n in enumerate(lengths):
        keys = _randn(n, 1, 576, seed=22 + b)
        cache[b, :n] = keys
        for p in range(-(-n // 64)):
            pool[int(table[b, p]), :keys[p * 64:(p + 1) * 64].shape[0]] = keys[p * 64:(p + 1) * 64]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    ok = True
    for kv, bt in ((cache, None), (pool, table)):
        out, lse = mla_decode(q, kv, seqlens, spec, block_table=bt, num_splits=3)
        for b, (ref, _) in enumerate(mla_reference(q, kv, lengths, spec, bt)):
            ok &= bool(torch.isfinite(out[b]).all()) and float((out[b].double() - ref).abs().max()) < 0.05
    return ok


def fp8_forward():
    """The fp8 forward (Hopper), GQA, a window, odd lengths, against the dequantised reference."""
    from fa_gen import fp8
    from fa_gen.reference import attention_reference

    if torch.cuda.get_device_capability() != (9, 0):
        return True  # Hopper's alone
    spec = load_spec({"name": "sanitize_fp8", "dtype": "fp8_e4m3", "head_dim": 128,
                      "mask": {"kind": "sliding_window", "left": 90, "right": 0}})
    q8, k8, v8 = ((_randn(2, s, h, 128, dtype=torch.float32, seed=30 + i) * 20).to(fp8.E4M3)
                  for i, (s, h) in enumerate(((333, 4), (517, 2), (517, 2))))
    descales = tuple(torch.rand(2, 2, device="cuda") * 0.01 + 0.01 for _ in range(3))
    out, lse = fa_gen.attention_fp8(q8, k8, v8, spec, *descales)
    ref, _ = attention_reference(*(fp8.dequantize(x, d) for x, d in zip((q8, k8, v8), descales)), spec)
    return bool(torch.isfinite(out).all()) and float((out.double() - ref).abs().max()) < 0.1 * float(ref.abs().max())


def shifted():
    """The ring's shifted forward and backward kinds (context parallelism), 3 simulated ranks, causal."""
    from fa_gen.distributed import simulate_ring_attention
    from fa_gen.reference import attention_reference

    spec = resolve_spec("causal_bf16_d128")
    q, k, v = (_randn(1, 300, 2, 128, seed=40 + i).requires_grad_() for i in range(3))
    out, lse = simulate_ring_attention(q, k, v, spec, 3, layout="zigzag")
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref, _ = attention_reference(q.detach(), k.detach(), v.detach(), spec)
    return float((out.detach().double() - ref).abs().max()) < 0.02 and all(torch.isfinite(g).all() for g in grads)


def sm80_family():
    """The Ampere-class family's forward and backward on this GPU (sm_90a runs them too)."""
    from fa_gen.backward import build_backward

    spec = resolve_spec("sliding_window_bf16_d128")
    q, k, v = _randn(2, 157, 4, 128, seed=50), _randn(2, 263, 2, 128, seed=51), _randn(2, 263, 2, 128, seed=52)
    kernel = fa_gen.build(spec, family="sm80")
    out, lse = kernel.forward(q, k, v)
    grads = build_backward(spec, family="sm80")(torch.ones_like(out), q, k, v, out, lse)
    return compare(spec, q, k, v, out, lse).ok and all(torch.isfinite(g).all() for g in grads)


def fp8_varlen():
    """The fp8 varlen forward (Hopper): V^T per sequence padded to whole key tiles, an empty
    sequence and one with seqlen_k < seqlen_q, each sequence against its own dequantised reference."""
    from fa_gen import fp8
    from fa_gen.api import attention_fp8_varlen
    from fa_gen.reference import attention_reference

    if torch.cuda.get_device_capability() != (9, 0):
        return True  # Hopper's alone
    spec = load_spec({"name": "sanitize_fp8_varlen", "dtype": "fp8_e4m3", "head_dim": 128, "mask": "causal"})
    len_q, len_k = [130, 0, 257], [200, 9, 70]
    q8, k8, v8 = ((_randn(sum(n), h, 128, dtype=torch.float32, seed=40 + i) * 20).to(fp8.E4M3)
                  for i, (n, h) in enumerate(((len_q, 4), (len_k, 2), (len_k, 2))))
    descales = tuple(torch.rand(3, 2, device="cuda") * 0.01 + 0.01 for _ in range(3))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (len_q, len_k))
    out, _ = attention_fp8_varlen(q8, k8, v8, cu_q, cu_k, max(len_q), max(len_k), spec, *descales)
    ok = bool(torch.isfinite(out).all())
    for b in (0, 2):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        parts = [fp8.dequantize(x[None], d[b:b + 1]) for x, d in zip((q8[rows], k8[keys], v8[keys]), descales)]
        ref, _ = attention_reference(*parts, spec)
        ok &= float((out[rows].double() - ref[0]).abs().max()) < 0.1 * float(ref.abs().max())
    return ok


CASES = {
    "fixed_forward": fixed_forward,
    # Causal d64 up to 1k keys takes Hopper's short-sequence forward kind.
    "short_forward": lambda: fixed_forward("causal_fp16_d64", sq=300, sk=300),
    "backward": backward,
    "varlen": varlen,
    "split_decode": split_decode,
    "paged_append": paged_append,
    "rotary_append": rotary_append,
    "rotary_interleaved": lambda: rotary_append(True),
    "alibi_supplied": lambda: expression("alibi_supplied"),
    "sink_logit": lambda: expression("sink_logit"),
    "padded_head_dim": padded_head_dim,
    "dropout": dropout,
    "mla": mla,
    "fp8_forward": fp8_forward,
    "fp8_varlen": fp8_varlen,
    "shifted": shifted,
    "sm80_family": sm80_family,
}


def run_tools(cases: list[str], out_dir: Path, tools=TOOLS, kernels: str | None = None,
              per_case: bool = False, case_timeout: float | None = None) -> int:
    """Each tool over the cases (kernels already compiled); one summary line per tool, or with
    `per_case` one per (tool, case), each its own process and log (a slow tool, initcheck on
    everything, then reports what finished). `kernels`: check only kernels whose name holds this
    text (fa_gen's: "kernel_cutlass"), not PyTorch's; initcheck then leaves host API copies alone
    (--check-api-memory-access no): run on everything, it reported PyTorch's cudaMemcpy of
    buffers the reference builds, one error per 32 bytes (which also made it slow), none of them
    an fa_gen kernel's read. PyTorch's caching allocator is off under the tools, so each tensor
    is an allocation of its own for them. `case_timeout`: seconds one process may take (its log
    says so, and the next one runs)."""
    failed = 0
    only = ["--kernel-name", f"kns={kernels}"] if kernels else []
    environ = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    for tool in tools:
        for group in ([[c] for c in cases] if per_case else [cases]):
            label = tool + (f"-{group[0]}" if per_case else "")
            log = out_dir / f"sanitize-{label}.log"
            api = ["--check-api-memory-access", "no"] if tool == "initcheck" and kernels else []
            command = ["compute-sanitizer", "--tool", tool, "--print-limit", "50", *only, *api, sys.executable,
                       __file__, *group]
            start = time.time()
            try:
                result = subprocess.run(command, capture_output=True, text=True, env=environ, timeout=case_timeout)
                text, returncode = result.stdout + result.stderr, result.returncode
            except subprocess.TimeoutExpired as timeout:
                text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                               for part in (timeout.stdout, timeout.stderr))
                text, returncode = text + f"\ntimed out after {case_timeout} s\n", 124
            log.write_text(text)
            # The total ("ERROR SUMMARY: N errors"), not the "M errors were not printed" line after it.
            summary = next((line for line in reversed(text.splitlines())
                            if re.search(r"(ERROR|RACECHECK) SUMMARY: \d+ (errors?|hazards?)", line)
                            and "not printed" not in line), f"no summary (rc {returncode})")
            print(f"{label}: {summary.strip()} ({time.time() - start:.0f} s, rc {returncode})", flush=True)
            failed += returncode != 0
    return failed


def _trace_tensors() -> None:
    """Print every CUDA tensor a torch op makes (TENSOR <op> <address> <bytes> <shape> <dtype>), so
    that count_errors can say whose memory a flagged address is (or past whose end it lies)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen = set()

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().data_ptr() not in seen:
                    storage = t.untyped_storage()
                    seen.add(storage.data_ptr())
                    print(f"TENSOR {func} {storage.data_ptr():#x} {storage.nbytes()} {list(t.shape)} {t.dtype}",
                          flush=True)
            return result

    Trace().__enter__()


def _attribute(address: int, tensors: list[tuple[int, int, str]]) -> str:
    """Which traced tensor `address` falls in, or past whose end (by how many bytes)."""
    below = [(base, size, what) for base, size, what in tensors if base <= address]
    if not below:
        return "no traced tensor below it"
    base, size, what = max(below)
    inside = address - base
    return f"{what} +{inside}" if inside < size else f"{inside - size} bytes past the end of {what} ({size} bytes)"


def _unchecked(*args, **kwargs):
    """compare() that computes nothing (FA_GEN_SANITIZE_UNCHECKED): every result counts as right."""
    return type("Unchecked", (), {"ok": True})()


def count_errors(cases: list[str], out_dir: Path, tool: str, kernels: str | None, api_checks: bool,
                 case_timeout: float | None) -> int:
    """One process per case under `tool` with every error printed but not kept: the errors counted
    by (kind, where: the kernel, or the API call for a host access), one JSON per case. For
    initcheck with host API accesses checked (`api_checks`), the memory cudaMemcpy/cudaMemset
    initialise counts as initialised, so a kernel read flagged there is a real one."""
    import collections
    import json
    import re

    only = ["--kernel-name", f"kns={kernels}"] if kernels else []
    api = [] if api_checks else ["--check-api-memory-access", "no"]
    environ = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", FA_GEN_SANITIZE_UNCHECKED="1",
                   FA_GEN_SANITIZE_TRACE="1")
    failed = 0
    for case in cases:
        command = ["compute-sanitizer", "--tool", tool, "--print-limit", "100000000", *only, *api, sys.executable,
                   __file__, case]
        counts, total, kind, start = collections.Counter(), None, None, time.time()
        addresses, tensors, address = collections.defaultdict(list), [], None
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ)
        try:
            for line in process.stdout:
                body = line.removeprefix("=========").strip()
                if time.time() - start > (case_timeout or float("inf")):
                    process.kill()
                    break
                if line.startswith("TENSOR "):
                    _, op, base, size, *what = line.split()
                    tensors.append((int(base, 16), int(size), f"{op} {' '.join(what)}"))
                elif re.match(r"(Uninitialized|Invalid|Host API|Race|Barrier|Misaligned)", body):
                    kind = re.split(r" of size| at host| at 0x", body)[0]
                elif kind and body.startswith(("at ", "Uninitialized access", "Invalid access")):
                    where = re.sub(r"\+0x[0-9a-f]+$", "", body.split(" on access by ")[-1].removeprefix("at "))
                    label = f"{kind} | {where[:120]}"
                    counts[label] += 1
                    kind = None
                elif label_address := re.match(r"Address (0x[0-9a-f]+)", body):
                    address = int(label_address.group(1), 16)
                    if counts and len(addresses[label]) < 6:
                        addresses[label].append(address)
                elif match := re.search(r"ERROR SUMMARY: (\d+) errors?$", body):
                    total = int(match.group(1))
        finally:
            process.wait()
        result = {"case": case, "tool": tool, "api_checks": api_checks, "seconds": round(time.time() - start, 1),
                  "total": total, "finished": total is not None, "by_kind_and_place": dict(counts.most_common()),
                  "first_addresses": {k: [f"{a:#x}: {_attribute(a, tensors)}" for a in v]
                                      for k, v in addresses.items()}}
        (out_dir / f"count-{tool}-{case}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"{tool}-{case}: total {total} in {result['seconds']} s; "
              + "; ".join(f"{n} x {k}" for k, n in counts.most_common(4)), flush=True)
        for k, v in result["first_addresses"].items():
            print(f"  {k[:90]}: {v[:3]}", flush=True)
        failed += total != 0
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="cases to run (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--tools", action="store_true", help="run every compute-sanitizer tool over the cases")
    parser.add_argument("--tool", action="append", choices=TOOLS, help="with --tools: only this tool (repeatable)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--kernels", help="with --tools: check only kernels whose name holds this text")
    parser.add_argument("--per-case", action="store_true", help="with --tools: one process and summary per case")
    parser.add_argument("--case-timeout", type=float, help="with --tools: seconds one sanitizer process may take")
    parser.add_argument("--count", action="store_true",
                        help="with --tools and one --tool: count every error by kind and kernel, per case")
    parser.add_argument("--api-checks", choices=("yes", "no"), default="yes",
                        help="with --count: check (and track) host API memory accesses")
    args = parser.parse_args()
    cases = args.cases or list(CASES)
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    if args.list:
        print("\n".join(CASES))
        return 0
    if args.tools:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        ready = []
        for name in cases:  # compile (and check) outside the sanitizer first
            try:
                ok = CASES[name]()
            except Exception as exc:  # one broken case must not keep the others from the tools
                ok = False
                print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
            print(f"{name}: {'ok' if ok else 'WRONG'} unsanitized", flush=True)
            ready += [name] if ok else []
        if args.count:
            return count_errors(ready, Path(args.out), (args.tool or TOOLS)[0], args.kernels, args.api_checks == "yes",
                                args.case_timeout) + (len(ready) < len(cases))
        return run_tools(ready, Path(args.out), tuple(args.tool or TOOLS), args.kernels, args.per_case,
                         args.case_timeout) \
            + (len(ready) < len(cases))
    if os.environ.get("FA_GEN_SANITIZE_TRACE"):
        _trace_tensors()
    if os.environ.get("FA_GEN_SANITIZE_UNCHECKED"):
        # Under count_errors: the results were checked in the unsanitized pass; the reference's
        # own copies (float64 tensors, masked fills) would only add host API reports.
        global compare
        compare = _unchecked
    bad = [name for name in cases if not CASES[name]()]
    torch.cuda.synchronize()
    print("wrong results:", ", ".join(bad) if bad else "none", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
