"""L1: non-finite values a sequence cannot see never reach its output (issue 24, item 2).

What fa_gen promises (docs/inference.md, "Non-finite inputs"): NaN or Inf in keys or values
*outside a sequence* never reach that sequence's output or gradients. That covers another
sequence of a packed batch, cache slots past cache_seqlens / seqused_k, the rest of a page, and
pages the table does not name. Inside a sequence, a NaN in a visible key or value propagates as
PyTorch's softmax and P @ V would. A value hidden by the mask but loaded in the same tile as a
visible one may propagate too (0 × NaN in the tile's P @ V); so does PyTorch's dense math, which
multiplies every masked probability.

Each case poisons what the sequence must not see with NaN and +Inf, then compares the
sequence's output (and gradients, where there is a backward) with the float64 reference of
its own tensors alone.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_nonfinite.py
"""

from __future__ import annotations

import math

import pytest
import torch

import fa_gen
from fa_gen.check import _rounding_floor
from fa_gen.reference import attention_reference, attention_same_precision
from fa_gen.runtime import resolve_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPEC = resolve_spec("causal_bf16_d128")
# (seqlen_q, seqlen_k) of a packed batch; sequence 1 is the poisoned neighbour.
LENGTHS = [(37, 120), (50, 77), (200, 90), (1, 1)]


def _randn(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)


def _check(out, q, k, v, what):
    ref, _ = attention_reference(q, k, v, SPEC)
    same = attention_same_precision(q, k, v, SPEC)
    tol = 2 * (same.double() - ref).abs().max().item() + _rounding_floor(ref, q.dtype)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    assert (out.double() - ref).abs().max().item() <= tol, what


@pytest.mark.parametrize("path", ["public", "forward_varlen", "whole_range"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_poisoned_neighbour_in_a_packed_batch_leaves_the_others_alone(path, poison):
    """Sequence 1's keys and values are all NaN (or Inf): every other sequence's output and
    gradients match the reference of that sequence alone (the last key tile of sequence 0 spans
    sequence 1's rows, and so does the first of sequence 2 in a TMA load from the packed tensor)."""
    from fa_gen.inference import forward_varlen

    cq = torch.tensor([0] + [sum(a for a, _ in LENGTHS[:i + 1]) for i in range(len(LENGTHS))], dtype=torch.int32,
                      device="cuda")
    ck = torch.tensor([0] + [sum(b for _, b in LENGTHS[:i + 1]) for i in range(len(LENGTHS))], dtype=torch.int32,
                      device="cuda")
    q, k, v = _randn(int(cq[-1]), 4, 128, seed=1), _randn(int(ck[-1]), 2, 128, seed=2), _randn(int(ck[-1]), 2, 128, seed=3)
    bad = slice(int(ck[1]), int(ck[2]))
    k[bad], v[bad] = poison, poison
    if path == "public":  # fa_gen.attention_varlen, with its backward
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, _ = fa_gen.attention_varlen(q, k, v, cq, ck, 200, 120, SPEC)
        dout = _randn(*out.shape, seed=4)
        out.backward(dout)
    elif path == "whole_range":  # one split: the whole-range kind (Hopper's TMA kernel there)
        out, _ = forward_varlen(SPEC, q, k, v, cq, ck, 200, 120, num_splits=1, pack_gqa=False)
    else:
        out, _ = forward_varlen(SPEC, q, k, v, cq, ck, 200, 120)
    for b, (sq, sk) in enumerate(LENGTHS):
        if b == 1:
            continue
        rows, keys = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        parts = (q.detach()[rows][None], k.detach()[keys][None], v.detach()[keys][None])
        _check(out.detach()[rows][None], *parts, f"sequence {b} next to a {poison} sequence ({path})")
        if path == "public":
            for name, grad, span in (("dq", q.grad, rows), ("dk", k.grad, keys), ("dv", v.grad, keys)):
                assert torch.isfinite(grad[span]).all(), f"sequence {b} {name} took the neighbour's {poison}"


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_cache_slots_past_each_length_are_never_read(paged, poison):
    """attention_with_kvcache: every cache slot past cache_seqlens (and every page the table does
    not name) holds NaN or Inf; decode and 5-token chunks see only their sequences' keys."""
    batch, page, capacity = 3, 16, 160
    lengths = [0, 17, 150]
    for seqlen_q in (1, 5):
        q = _randn(batch, seqlen_q, 8, 128, seed=5)
        keys = [_randn(n + seqlen_q, 2, 128, seed=6 + b) for b, n in enumerate(lengths)]
        values = [_randn(n + seqlen_q, 2, 128, seed=16 + b) for b, n in enumerate(lengths)]
        if paged:
            pages = batch * capacity // page + 4
            table = torch.randperm(pages, device="cuda")[:batch * capacity // page].view(batch, -1).to(torch.int32)
            k_cache = torch.full((pages, page, 2, 128), poison, dtype=torch.bfloat16, device="cuda")
            v_cache = torch.full_like(k_cache, poison)
            for b, n in enumerate(lengths):
                for r in range(n):
                    k_cache[table[b, r // page], r % page] = keys[b][r]
                    v_cache[table[b, r // page], r % page] = values[b][r]
        else:
            table = None
            k_cache = torch.full((batch, capacity, 2, 128), poison, dtype=torch.bfloat16, device="cuda")
            v_cache = torch.full_like(k_cache, poison)
            for b, n in enumerate(lengths):
                k_cache[b, :n], v_cache[b, :n] = keys[b][:n], values[b][:n]
        k_new = torch.stack([keys[b][n:] for b, n in enumerate(lengths)])
        v_new = torch.stack([values[b][n:] for b, n in enumerate(lengths)])
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        out, _ = fa_gen.attention_with_kvcache(q, k_cache, v_cache, seqlens, SPEC, k_new=k_new, v_new=v_new,
                                               page_table=table)
        for b in range(batch):
            _check(out[b:b + 1], q[b:b + 1], keys[b][None], values[b][None],
                   f"{'paged' if paged else 'contiguous'} sequence {b}, seqlen_q {seqlen_q}, {poison} past its keys")


def test_split_decode_ignores_keys_past_seqused():
    """The split-KV varlen kinds with seqused_k: NaN keys and values past each sequence's used
    keys (a padded cache, read as one packed tensor)."""
    from fa_gen.inference import forward_varlen

    used = [1, 64, 200]
    capacity = 256
    q = _randn(3, 8, 128, seed=30)
    k = torch.full((3 * capacity, 2, 128), math.nan, dtype=torch.bfloat16, device="cuda")
    v = torch.full_like(k, math.nan)
    for b, n in enumerate(used):
        k[b * capacity:b * capacity + n] = _randn(n, 2, 128, seed=31 + b)
        v[b * capacity:b * capacity + n] = _randn(n, 2, 128, seed=41 + b)
    cq = torch.arange(4, dtype=torch.int32, device="cuda")
    ck = torch.arange(0, 4 * capacity, capacity, dtype=torch.int32, device="cuda")
    out, _ = forward_varlen(SPEC, q, k, v, cq, ck, 1, capacity, torch.tensor(used, dtype=torch.int32, device="cuda"))
    for b, n in enumerate(used):
        keys = slice(b * capacity, b * capacity + n)
        _check(out[b:b + 1][None], q[b:b + 1][None], k[keys][None], v[keys][None], f"sequence {b} of {n} used keys")
