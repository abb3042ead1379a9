"""L1: MLA decode (fa_gen.mla_decode, Hopper) against the float64 reference, sequence by sequence.

Contiguous and paged caches (shuffled page tables), seqlen_q 1-16 (causal multi-token decode
and unmasked), odd head counts, lengths from 0 to the cache's capacity, any split count
(splits with no key tile included). Every cache slot a sequence does not own holds NaN: a
kernel that lets one reach O (0 * NaN through P V, or an unmasked key) fails here.

Run on a Hopper GPU:  python -m pytest -m gpu tests/test_gpu_mla.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.check import _rounding_floor
from fa_gen.mla import mla_decode, mla_reference
from fa_gen.reference import attention_same_precision
from fa_gen.spec_load import load_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a Hopper GPU (L1)"),
]

SPECS = [
    load_spec({"name": "mla_causal_bf16", "dtype": "bf16", "head_dim": {"qk": 576, "v": 512}, "mask": "causal",
               "softmax_scale": 192 ** -0.5}),
    load_spec({"name": "mla_fp16", "dtype": "fp16", "head_dim": {"qk": 576, "v": 512}}),
]


def make_cache(spec, lengths, capacity, page_size, generator):
    """(kv_cache, block_table or None): the sequences' keys at random values, every other slot NaN;
    paged: pages drawn in shuffled order from a pool larger than needed."""
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    batch = len(lengths)
    keys = [torch.randn(n, 1, 576, generator=generator, device="cuda").to(dtype) for n in lengths]
    if page_size is None:
        cache = torch.full((batch, capacity, 1, 576), math.nan, dtype=dtype, device="cuda")
        for b, k in enumerate(keys):
            cache[b, :k.shape[0]] = k
        return cache, None
    max_pages = -(-capacity // page_size)
    pool = batch * max_pages + 3
    order = torch.randperm(pool, generator=generator, device="cuda").to(torch.int32)
    table = order[:batch * max_pages].view(batch, max_pages).contiguous()
    cache = torch.full((pool, page_size, 1, 576), math.nan, dtype=dtype, device="cuda")
    for b, k in enumerate(keys):
        for p in range(-(-k.shape[0] // page_size)):
            rows = k[p * page_size:(p + 1) * page_size]
            cache[table[b, p].item(), :rows.shape[0]] = rows
    return cache, table


def check_sequences(spec, q, cache, table, lengths, out, lse):
    """Each sequence's out and lse against the reference over its keys alone."""
    refs = mla_reference(q, cache, lengths, spec, table)
    for b, (ref, ref_lse) in enumerate(refs):
        k = _keys(cache, table, b, lengths[b])
        same = attention_same_precision(q[b:b + 1], k, k[..., :512], spec)[0]
        tol = 2 * (same.double() - ref).abs().max().item() + _rounding_floor(ref, q.dtype) if ref.numel() else 0
        got = out[b].double()
        assert torch.isfinite(got).all(), f"sequence {b} (length {lengths[b]}): non-finite output"
        err = (got - ref).abs().max().item()
        assert err <= tol, f"sequence {b} (length {lengths[b]}): out err {err:.3e} > {tol:.3e}"
        visible = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[b]), visible), f"sequence {b}: LSE -inf rows differ"
        if visible.any():
            assert (lse[b][visible].double() - ref_lse[visible]).abs().max().item() <= 1e-3, f"sequence {b}: lse"


def _keys(cache, table, b, length):
    if table is None:
        return cache[b:b + 1, :length]
    page = cache.shape[1]
    pages = table[b, :-(-length // page)].long()
    return cache[pages].reshape(1, -1, 1, 576)[:, :length]


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_mla_decode_matches_reference_per_sequence(data, seed):
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    paged = data.draw(st.booleans(), label="paged")
    page_size = data.draw(st.sampled_from((64, 128)), label="page_size") if paged else None
    batch = data.draw(st.integers(1, 4), label="batch")
    seqlen_q = data.draw(st.sampled_from((1, 1, 2, 3, 16)), label="seqlen_q")
    heads_q = data.draw(st.sampled_from((1, 7, 16, 40, 128)), label="heads_q")
    capacity = data.draw(st.integers(1, 700), label="capacity")
    lengths = data.draw(st.lists(st.integers(0, capacity), min_size=batch, max_size=batch), label="lengths")
    splits = data.draw(st.sampled_from((None, 1, 2, 3, 7)), label="num_splits")
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16
    q = torch.randn(batch, seqlen_q, heads_q, 576, generator=g, device="cuda").to(dtype)
    cache, table = make_cache(spec, lengths, capacity, page_size, g)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = mla_decode(q, cache, seqlens, spec, block_table=table, num_splits=splits)
    assert out.shape == (batch, seqlen_q, heads_q, 512) and lse.shape == (batch, heads_q, seqlen_q)
    check_sequences(spec, q, cache, table, lengths, out, lse)


def test_long_sequences_split_and_whole_agree_with_reference():
    """8k and 20k keys, 128 heads, paged and contiguous, the heuristic's splits and one split."""
    spec = SPECS[0]
    g = torch.Generator(device="cuda").manual_seed(7)
    lengths = [8192, 20000 - 37]
    q = torch.randn(2, 1, 128, 576, generator=g, device="cuda").to(torch.bfloat16)
    for page_size in (None, 64):
        cache, table = make_cache(spec, lengths, 20480, page_size, g)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        for splits in (None, 1):
            out, lse = mla_decode(q, cache, seqlens, spec, block_table=table, num_splits=splits)
            check_sequences(spec, q, cache, table, lengths, out, lse)


def test_v_is_the_latent_part_of_the_cache():
    """Changing a cache's rope columns moves the scores but V is the latent 512: with the rope
    columns of q zero, the output does not move."""
    spec = SPECS[1]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 1, 16, 576, generator=g, device="cuda").half()
    q[..., 512:] = 0
    cache, _ = make_cache(spec, [300], 320, None, g)
    first, _ = mla_decode(q, cache, 300, spec)
    cache[0, :300, :, 512:] = torch.randn(300, 1, 64, generator=g, device="cuda").half()
    assert torch.equal(first, mla_decode(q, cache, 300, spec)[0])
    cache[0, 5, :, 3] += 1
    assert not torch.equal(first, mla_decode(q, cache, 300, spec)[0])


def test_flash_mla_signature_gives_mla_decode_results():
    """fa_gen.api.flash_mla_with_kvcache (FlashMLA's call) on a paged cache: bitwise what
    mla_decode gives under the spec it builds, and right against the reference."""
    from fa_gen.api import flash_mla_with_kvcache, get_mla_metadata

    spec = SPECS[0]
    g = torch.Generator(device="cuda").manual_seed(11)
    lengths = [5, 700, 64]
    q = torch.randn(3, 2, 16, 576, generator=g, device="cuda").to(torch.bfloat16)
    cache, table = make_cache(spec, lengths, 704, 64, g)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    metadata, splits = get_mla_metadata(seqlens, 2 * 16, 1)
    out, lse = flash_mla_with_kvcache(q, cache, table, seqlens, 512, metadata, splits, softmax_scale=192 ** -0.5,
                                      causal=True)
    want, want_lse = mla_decode(q, cache, seqlens, spec, block_table=table)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    check_sequences(spec, q, cache, table, lengths, out, lse)
