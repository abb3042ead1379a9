"""L1: fa_gen.attention_with_kvcache (append + attend, paged and contiguous caches, CUDA graphs)
against the float64 reference.

Run on a GPU machine:  python -m pytest -m gpu tests/test_gpu_kvcache.py
Each sequence is judged against the reference of that sequence alone, on its keys gathered
into one contiguous tensor (fa_gen.check.compare). Cache slots that belong to no sequence
hold NaN, so a kernel that reads a slot it should not (past a sequence's end, an unlisted
page) gives NaN; the append must leave every other slot bit for bit as it was.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fa_gen
from fa_gen.check import compare
from fa_gen.reference import rotary_reference
from fa_gen.runtime import resolve_spec
from fa_gen.spec_load import load_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (L1)"),
]

SPECS = [
    resolve_spec("causal_bf16_d128"),
    load_spec({"name": "kv_window_bf16_d128", "dtype": "bf16", "head_dim": 128,
               "mask": {"kind": "sliding_window", "left": 100, "right": 0}}),
    load_spec({"name": "kv_full_fp16_d64", "dtype": "fp16", "head_dim": 64, "mask": "none"}),
    resolve_spec("softcap"),  # a score-mod expression with a runtime scalar
    resolve_spec("chunked_causal"),  # a mask expression (every visited tile applies it)
    resolve_spec("sink_logit"),  # a sink logit (split 0's partial only)
]
GROUPS = (1, 2, 4, 8)
PAGE_SIZES = (1, 16, 32, 48, 64, 256)


def _kinds(spec):
    from fa_gen.families.sm80 import gqa_packable
    from fa_gen.inference import packed_kind, supports
    from fa_gen.runtime import current_arch

    # Contiguous caches take the varlen split kinds too (fa_gen.api.kvcache._attend_contiguous).
    groups = GROUPS if gqa_packable(spec) else (1,)
    bases = ("forward_varlen_split_paged", "forward_varlen_split_paged_tiles", "forward_varlen_split_paged_groups",
             "forward_varlen_split")
    kinds = [packed_kind(base, g) for base in bases for g in groups]
    # Decode steps short of a wave take the wide twins of the contiguous kinds (64 x 128 tiles).
    wide = [packed_kind("forward_varlen_split_wide", g) for g in groups]
    return kinds + [kind for kind in wide if supports(spec, current_arch(), kind)]


@pytest.fixture(scope="module")
def arch():
    """Every kind the tests call, compiled up front (in parallel with FA_GEN_PRECOMPILE_JOBS)."""
    from fa_gen.precompile import precompile_kinds
    from fa_gen.runtime import current_arch

    arch = current_arch()
    work = [(spec, arch, kind) for spec in SPECS for kind in _kinds(spec)]
    work += sorted({_whole_kind(spec, arch, p) for spec in WHOLE_SPECS for p in WHOLE_PAGE_SIZES} - {None}, key=str)
    work += [(rows, arch, "forward_seqused") for rows in map(lambda s: _rows_spec(s, arch), ROWS_SPECS) if rows]
    precompile_kinds(work, int(os.environ.get("FA_GEN_PRECOMPILE_JOBS", "0")))
    return arch


# Page sizes of the whole-range paged kind's test: TMA boxes of gcd(page_size, tile_n) rows (8,
# 16, 64 and 128 at tile_n 128; 24 and 48 take boxes of 8 and 16 that a page holds three of).
WHOLE_PAGE_SIZES = (8, 16, 24, 48, 64, 128, 256, 512)
# Its specs: those above that it serves (no mask expression, no sink logit), and head dims whose
# key tiles are 96 rows (boxes of 8 / 16 / 24 / 32 / 48) and 128 rows beside a narrower V.
WHOLE_SPECS = SPECS + [resolve_spec("causal_topleft_fp16_d96"), resolve_spec("causal_bf16_qk192_v128")]


# Specs of the heads-as-rows decode test (fa_gen.inference.cache_rows_route).
ROWS_SPECS = (resolve_spec("causal_bf16_d128"), resolve_spec("softcap"))


def _rows_spec(spec, arch):
    from fa_gen.inference import rows_spec

    return rows_spec(spec, arch)


def _whole_kind(spec, arch, page_size):
    from fa_gen.inference import whole_paged_kind

    found = whole_paged_kind(spec, arch, page_size)
    return found and (spec, arch, found[0])


def _dtype(spec):
    return torch.bfloat16 if spec.dtype.value == "bf16" else torch.float16


def _inputs(spec, generator, heads_q):
    if spec.name == "softcap":
        return {"softcap": 5.0 + 45.0 * float(torch.rand((), generator=generator, device="cuda"))}
    if spec.name == "chunked_causal":
        return {"chunk": int(torch.randint(1, 300, (), generator=generator, device="cuda"))}
    if spec.name == "sink_logit":
        return {"sinks": 2.0 * torch.randn(heads_q, generator=generator, device="cuda")}
    return None


class Case:
    """One call's tensors: per sequence b its logical keys/values (cache_lengths[b] + seqlen_new rows),
    laid out in a paged or contiguous cache whose other slots are NaN; k_new/v_new are the last
    seqlen_new rows, not yet in the cache."""

    def __init__(self, spec, cache_lengths, seqlen_q, seqlen_new, heads, generator, page_size=None, slack=0,
                 shuffle=True):
        self.spec, self.lengths, self.seqlen_new = spec, list(cache_lengths), seqlen_new
        heads_q, heads_kv = heads
        batch, dtype = len(cache_lengths), _dtype(spec)

        def draw(*shape):
            return torch.randn(*shape, generator=generator, device="cuda").to(dtype)

        totals = [n + seqlen_new for n in cache_lengths]
        self.q = draw(batch, seqlen_q, heads_q, spec.head_dim_qk)
        self.keys = [draw(n, heads_kv, spec.head_dim_qk) for n in totals]
        self.values = [draw(n, heads_kv, spec.head_dim_v) for n in totals]
        self.k_new = torch.stack([k[n:] for k, n in zip(self.keys, cache_lengths)]) if seqlen_new else None
        self.v_new = torch.stack([v[n:] for v, n in zip(self.values, cache_lengths)]) if seqlen_new else None
        self.cache_seqlens = torch.tensor(cache_lengths, dtype=torch.int32, device="cuda")
        self.page_table = self.cache_batch_idx = None
        if page_size is None:
            self._contiguous(max(max(totals) + slack, 1), heads_kv, generator, shuffle)
        else:
            self._paged(page_size, totals, slack, heads_kv, generator, shuffle)

    def _paged(self, page_size, totals, slack, heads_kv, generator, shuffle):
        """Pages of all sequences in a random order, plus unused ones; table entries past a
        sequence's pages point at an unused (NaN) page."""
        needed = [math.ceil(n / page_size) for n in totals]
        num_pages = sum(needed) + 2
        order = torch.randperm(num_pages, generator=generator, device="cuda") if shuffle else \
            torch.arange(num_pages, device="cuda")
        max_pages = max(max(needed) + slack, 1)
        self.page_table = torch.full((len(totals), max_pages), int(order[-1]), dtype=torch.int32, device="cuda")
        shape = (num_pages, page_size, heads_kv)
        self.k_cache = torch.full((*shape, self.spec.head_dim_qk), math.nan, dtype=_dtype(self.spec), device="cuda")
        self.v_cache = torch.full((*shape, self.spec.head_dim_v), math.nan, dtype=_dtype(self.spec), device="cuda")
        first = 0
        for b, n in enumerate(self.lengths):
            pages = order[first:first + needed[b]]
            first += needed[b]
            self.page_table[b, :needed[b]] = pages.to(torch.int32)
            where = self._slots(b, 0, n)  # the rows already cached (the append writes the rest)
            self.k_cache[where] = self.keys[b][:n]
            self.v_cache[where] = self.values[b][:n]

    def _contiguous(self, seqlen_cache, heads_kv, generator, shuffle):
        batch = len(self.lengths)
        rows = batch + 1
        shape = (rows, seqlen_cache, heads_kv)
        self.k_cache = torch.full((*shape, self.spec.head_dim_qk), math.nan, dtype=_dtype(self.spec), device="cuda")
        self.v_cache = torch.full((*shape, self.spec.head_dim_v), math.nan, dtype=_dtype(self.spec), device="cuda")
        order = torch.randperm(rows, generator=generator, device="cuda")[:batch] if shuffle else None
        self.cache_batch_idx = order
        for b, n in enumerate(self.lengths):
            row = int(order[b]) if order is not None else b
            self.k_cache[row, :n] = self.keys[b][:n]
            self.v_cache[row, :n] = self.values[b][:n]

    def expected_caches(self):
        """The caches as the append must leave them."""
        k, v = self.k_cache.clone(), self.v_cache.clone()
        for b, n in enumerate(self.lengths):
            where = self._slots(b, n, n + self.seqlen_new)
            k[where], v[where] = self.keys[b][n:], self.values[b][n:]
        return k, v

    def _slots(self, b, start, stop):
        """(first index, second index) of key rows start..stop-1 of sequence b in the cache."""
        rows = torch.arange(start, stop, device="cuda")
        if self.page_table is not None:
            page_size = self.k_cache.shape[1]
            return self.page_table[b].long()[rows // page_size], rows % page_size
        row = int(self.cache_batch_idx[b]) if self.cache_batch_idx is not None else b
        return torch.full_like(rows, row), rows

    def call(self, **options):
        return fa_gen.attention_with_kvcache(self.q, self.k_cache, self.v_cache, self.cache_seqlens, self.spec,
                                             k_new=self.k_new, v_new=self.v_new, page_table=self.page_table,
                                             cache_batch_idx=self.cache_batch_idx, **options)

    def failures(self, out, lse, inputs):
        """compare() per sequence against the reference on its gathered keys."""
        failures = []
        for b in range(len(self.lengths)):
            result = compare(self.spec, self.q[b:b + 1], self.keys[b][None], self.values[b][None], out[b:b + 1],
                             lse[b:b + 1], inputs)
            if not result.ok:
                failures.append(f"sequence {b} {result}")
        return failures


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("spec", ROWS_SPECS, ids=lambda s: s.name)
def test_kvcache_decode_heads_as_rows(arch, monkeypatch, spec, whole):
    """A contiguous cache's decode step whose tiles fill the GPU: with WHOLE_DECODE the query heads
    of each KV head go as query rows through the forward_seqused kind of the spec's mask-free twin
    (the slots bound lowered so that 30 sequences of up to 700 keys take it); every sequence judged
    against its own reference, lengths 0, 1, tile edges and odd ones, NaN in every slot a sequence
    does not own, with and without a token appended first."""
    import fa_gen.api.kvcache as kvcache
    import fa_gen.inference as inference

    if _rows_spec(spec, arch) is None:
        pytest.skip(f"no family on {arch} serves the heads-as-rows decode")
    monkeypatch.setattr(inference, "WHOLE_DECODE", whole)
    monkeypatch.setattr(inference, "ROWS_MIN_SEQLEN_K", 64)
    taken, forward_cache_rows = [], kvcache.forward_cache_rows
    monkeypatch.setattr(kvcache, "forward_cache_rows", lambda *args: taken.append(args[0]) or forward_cache_rows(*args))
    generator = torch.Generator(device="cuda").manual_seed(17 + whole)
    lengths = [0, 1, 2, 63, 64, 65, 127, 128, 129, 699, 700] + torch.randint(
        0, 701, (19,), generator=generator, device="cuda").tolist()
    for seqlen_new in (0, 1):
        case = Case(spec, lengths, 1, seqlen_new, (32, 8), generator, None, slack=5, shuffle=False)
        # One cache row per sequence (Case keeps a spare row): the route reads cache row b as sequence b.
        case.k_cache, case.v_cache = case.k_cache[:len(lengths)], case.v_cache[:len(lengths)]
        inputs = _inputs(spec, generator, 32)
        out, lse = case.call(inputs=inputs)
        assert out.shape == (30, 1, 32, spec.head_dim_v) and lse.shape == (30, 32, 1)
        failures = case.failures(out, lse, inputs)
        assert not failures, f"{spec.name} whole={whole} new={seqlen_new}: " + "; ".join(failures)
    assert len(taken) == (2 if whole else 0) and all(not s.is_masked for s in taken)


def _same(a, b):
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


cache_length = st.one_of(st.sampled_from((0, 1)), st.integers(0, 300), st.integers(0, 3000))


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), lengths=st.lists(cache_length, min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1))
def test_kvcache_matches_reference_per_sequence(arch, data, lengths, seed):
    from fa_gen.families.sm80 import gqa_packable

    spec = data.draw(st.sampled_from(SPECS), label="spec")
    heads_kv = data.draw(st.integers(1, 2), label="heads_kv")
    group = data.draw(st.sampled_from(GROUPS), label="group")
    seqlen_q = data.draw(st.integers(1, 16), label="seqlen_q")
    seqlen_new = data.draw(st.sampled_from((0, 1, seqlen_q, 20)), label="seqlen_new")
    page_size = data.draw(st.sampled_from((None, *PAGE_SIZES)), label="page_size")
    slack = data.draw(st.integers(0, 2), label="slack")
    num_splits = data.draw(st.sampled_from((0, 1, 3)), label="num_splits")
    pack = data.draw(st.sampled_from((None, False, True)), label="pack_gqa")
    if pack and (group == 1 or not gqa_packable(spec)):
        pack = None
    generator = torch.Generator(device="cuda").manual_seed(seed)
    case = Case(spec, lengths, seqlen_q, seqlen_new, (heads_kv * group, heads_kv), generator, page_size, slack)
    inputs = _inputs(spec, generator, heads_kv * group)
    expected_k, expected_v = case.expected_caches()
    out, lse = case.call(num_splits=num_splits, pack_gqa=pack, inputs=inputs)
    assert out.shape == case.q.shape[:3] + (spec.head_dim_v,) and lse.shape == (len(lengths), heads_kv * group,
                                                                                 seqlen_q)
    assert _same(case.k_cache, expected_k) and _same(case.v_cache, expected_v), "the append wrote wrong slots"
    failures = case.failures(out, lse, inputs)
    assert not failures, f"page_size {page_size}, lengths {lengths}: " + "; ".join(failures)


@settings(max_examples=int(os.environ.get("FA_GEN_L1_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), lengths=st.lists(cache_length, min_size=1, max_size=4), seed=st.integers(0, 2**31 - 1))
def test_paged_whole_range_kind_matches_reference(arch, data, lengths, seed):
    """Chunks of up to 300 queries against paged caches through the whole-range paged kind
    (pinned by num_splits=1; on Hopper the sm90 family's: key tiles in TMA boxes inside pages).
    Slots past each sequence's keys, unlisted pages and table entries past its pages hold NaN."""
    from fa_gen.inference import whole_paged_kind

    if whole_paged_kind(SPECS[0], arch, 64) is None:
        pytest.skip(f"no family renders a whole-range paged kind on {arch}")
    spec = data.draw(st.sampled_from([s for s in WHOLE_SPECS if whole_paged_kind(s, arch, 64)]), label="spec")
    page_size = data.draw(st.sampled_from(WHOLE_PAGE_SIZES), label="page_size")
    heads_kv = data.draw(st.integers(1, 2), label="heads_kv")
    group = data.draw(st.sampled_from((1, 2, 4)), label="group")
    seqlen_q = data.draw(st.one_of(st.integers(1, 16), st.integers(17, 300)), label="seqlen_q")
    seqlen_new = data.draw(st.sampled_from((0, 1, seqlen_q)), label="seqlen_new")
    slack = data.draw(st.integers(0, 2), label="slack")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    case = Case(spec, lengths, seqlen_q, seqlen_new, (heads_kv * group, heads_kv), generator, page_size, slack)
    inputs = _inputs(spec, generator, heads_kv * group)
    expected_k, expected_v = case.expected_caches()
    out, lse = case.call(num_splits=1, pack_gqa=False, inputs=inputs)
    assert _same(case.k_cache, expected_k) and _same(case.v_cache, expected_v), "the append wrote wrong slots"
    failures = case.failures(out, lse, inputs)
    assert not failures, f"page_size {page_size}, lengths {lengths}: " + "; ".join(failures)


@pytest.mark.parametrize("page_size, rotary", [(None, False), (1, False), (16, False), (48, False), (256, False),
                                               (None, True), (16, True)])
def test_cuda_graph_replays_with_new_lengths_and_page_tables(arch, page_size, rotary):
    """One decode step (seqlen_q 1, one new token, GQA 4) captured once, replayed with new
    cache lengths, page tables and queries copied into the captured tensors; with `rotary`, the
    step also rotates q and the new key (its positions move with the new lengths)."""
    spec = SPECS[0]
    generator = torch.Generator(device="cuda").manual_seed(page_size or 7)
    heads = (8, 2)
    draws = [[0, 5, 700, 1], [33, 0, 1, 2000], [1999, 17, 300, 64]]
    cases = [Case(spec, lengths, 1, 1, heads, generator, page_size, slack=0, shuffle=True) for lengths in draws]
    # The captured tensors: sized for the largest draw (the graph's shapes never change).
    static = Case(spec, [2000] * 4, 1, 1, heads, generator, page_size, slack=0)
    options = {}
    if rotary:
        angles = torch.rand(2100, 32, generator=generator, device="cuda") * 2 * math.pi
        options = dict(rotary_cos=torch.cos(angles).to(torch.bfloat16), rotary_sin=torch.sin(angles).to(torch.bfloat16),
                       rotary_interleaved=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static.call(**options)  # compiles and loads every kernel of the step before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = static.call(**options)
    for case in cases:
        _load_into(static, case)
        expected_k, expected_v = case.expected_caches()
        graph.replay()
        torch.cuda.synchronize()
        region = _region(case)
        if rotary:  # the appended rows, rotated at their slots (the rest as the case left them)
            case.q = _rotated(case.q, options, case.cache_seqlens)
            for b, n in enumerate(case.lengths):
                where = case._slots(b, n, n + 1)
                expected_k[where] = _rotated(case.k_new[b:b + 1], options, case.cache_seqlens[b:b + 1])[0]
                case.keys[b] = torch.cat([case.keys[b][:n], static.k_cache[region][where]])
            close = (static.k_cache[region] - expected_k).abs() <= 2 ** -7 * expected_k.abs() + 2 ** -12
            assert bool((close | expected_k.isnan() & static.k_cache[region].isnan()).all()), "rotated keys"
        else:
            assert _same(static.k_cache[region], expected_k), "the append wrote wrong slots"
        assert _same(static.v_cache[region], expected_v)
        failures = case.failures(out, lse, None)
        assert not failures, f"lengths {case.lengths}: " + "; ".join(failures)


def _rotated(x, options, starts):
    """x (batch, 1, heads, d) rotated at rows starts (batch,) of the case's tables, float64 ->
    x's dtype (one new token and one query per sequence: the same positions)."""
    return rotary_reference(x, options["rotary_cos"], options["rotary_sin"], starts.long()[:, None],
                            options["rotary_interleaved"]).to(x.dtype)


def _load_into(static, case):
    """Copy a case's contents into the captured tensors (same shapes, new values)."""
    static.q.copy_(case.q)
    static.k_new.copy_(case.k_new)
    static.v_new.copy_(case.v_new)
    static.cache_seqlens.copy_(case.cache_seqlens)
    static.k_cache.fill_(math.nan)
    static.v_cache.fill_(math.nan)
    static.k_cache[_region(case)] = case.k_cache
    static.v_cache[_region(case)] = case.v_cache
    if case.page_table is not None:
        # Entries past the case's table name the static cache's last page, which the case leaves NaN.
        static.page_table.fill_(static.k_cache.shape[0] - 1)
        static.page_table[:, :case.page_table.shape[1]] = case.page_table
    elif case.cache_batch_idx is not None:
        static.cache_batch_idx.copy_(case.cache_batch_idx)


def _region(case):
    """Where a case's (smaller) caches sit in the captured ones: their leading corner."""
    return tuple(slice(0, n) for n in case.k_cache.shape[:2])


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "leftpad", "paged16", "paged64"])
@pytest.mark.parametrize("spec_index", [0, 2, 3])
def test_rotary_and_leftpad_match_reference(arch, interleaved, layout, spec_index):
    """flash_attn_with_kvcache's rotary_cos / rotary_sin and cache_leftpad: the new keys land in the
    cache rotated at their slots, queries are rotated at their own positions under a causal mask
    and at the first new token's without one, and each sequence attends its slots from its left pad
    on (the pad slots hold NaN: reading one fails the test)."""
    spec = SPECS[spec_index]
    dtype, dim = _dtype(spec), spec.head_dim_qk
    generator = torch.Generator(device="cuda").manual_seed(spec_index * 8 + 2 * interleaved + len(layout))
    pads = [0, 3, 0, 40, 7] if layout == "leftpad" else [0] * 5
    lengths = [0, 5, 77, 300, 1]  # keys each sequence holds before the call (after its pad)
    seqlen_q = seqlen_new = 3
    page_size = {"paged16": 16, "paged64": 64}.get(layout)
    case = Case(spec, [p + n for p, n in zip(pads, lengths)], seqlen_q, seqlen_new, (8, 2), generator, page_size,
                slack=1)
    for b, pad in enumerate(pads):  # the pad slots: NaN, never to be read
        if pad:
            case.k_cache[case._slots(b, 0, pad)] = math.nan
            case.v_cache[case._slots(b, 0, pad)] = math.nan
    rotary_dim = dim if interleaved else dim // 2
    angles = torch.rand(400, rotary_dim // 2, generator=generator, device="cuda") * 2 * math.pi
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    inputs = _inputs(spec, generator, 8)
    expected_k, expected_v = case.expected_caches()
    leftpad = torch.tensor(pads, dtype=torch.int32, device="cuda") if layout == "leftpad" else None
    out, lse = case.call(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, cache_leftpad=leftpad,
                         inputs=inputs)
    starts = case.cache_seqlens.long()
    key_positions = starts[:, None] + torch.arange(seqlen_new, device="cuda")
    own = spec.mask.value != "none" or spec.mask_expr is not None
    query_positions = key_positions if own else starts[:, None].expand(-1, seqlen_q)
    new_keys = rotary_reference(case.k_new, cos, sin, key_positions, interleaved)
    queries = rotary_reference(case.q, cos, sin, query_positions, interleaved).to(dtype)
    failures = []
    for b, (pad, n) in enumerate(zip(pads, lengths)):
        appended = case._slots(b, pad + n, pad + n + seqlen_new)
        got = case.k_cache[appended].double()
        # One rounding to the cache's dtype after float32 arithmetic.
        assert ((got - new_keys[b]).abs() <= 2 ** -7 * new_keys[b].abs() + 2 ** -12).all(), f"sequence {b}: keys"
        assert torch.equal(case.v_cache[appended], case.v_new[b])
        expected_k[appended] = case.k_cache[appended]  # checked above; the rest must be as it was
        keys = case.k_cache[case._slots(b, pad, pad + n + seqlen_new)]
        values = case.v_cache[case._slots(b, pad, pad + n + seqlen_new)]
        result = compare(spec, queries[b:b + 1], keys[None], values[None], out[b:b + 1], lse[b:b + 1], inputs)
        if not result.ok:
            failures.append(f"sequence {b} {result}")
    assert _same(case.k_cache, expected_k) and _same(case.v_cache, expected_v), "the append wrote wrong slots"
    assert not failures, f"{layout}, interleaved {interleaved}: " + "; ".join(failures)


FP8_SPECS = [resolve_spec("fp8_e4m3_d128"),
             load_spec({"name": "kv_fp8_causal_fp16", "dtype": "fp8_e4m3", "out_dtype": "fp16", "head_dim": 128,
                        "mask": "causal"})]


def _fp8_bytes_into(cache8, where, rows8):
    cache8.view(torch.uint8)[where] = rows8.view(torch.uint8)


@pytest.mark.parametrize("page_size", [None, 1, 16, 48, 64, 256])
@pytest.mark.parametrize("spec_index", [0, 1])
def test_fp8_kvcache_matches_reference_per_sequence(page_size, spec_index):
    """e4m3 q, caches and new tokens with per-(sequence, kv head) descales (templates/common/
    fp8_staging.j2): every sequence against the float64 reference of its dequantised keys, within
    twice the fp8 yardstick's error (tests/test_gpu_fp8.py); the caches hold the appended bytes."""
    from fa_gen.fp8 import E4M3
    from tests.test_gpu_fp8 import _judge

    spec = FP8_SPECS[spec_index]
    g = torch.Generator(device="cuda").manual_seed(7919 * spec_index + (page_size or 0))
    lengths, seqlen_q, seqlen_new, heads = [0, 1, 77, 300, 1500], 3, 2, (16, 4)
    shadow = load_spec({"name": f"shadow_{spec.name}", "dtype": "bf16", "head_dim": 128, "mask": spec.mask.value})
    case = Case(shadow, lengths, seqlen_q, seqlen_new, heads, g, page_size=page_size)
    to8 = lambda x: (x.float() * 3).to(E4M3)  # noqa: E731
    q8, keys8, values8 = to8(case.q), [to8(k) for k in case.keys], [to8(v) for v in case.values]
    k_cache8, v_cache8 = (torch.full(c.shape, math.nan, device="cuda").to(E4M3) for c in (case.k_cache, case.v_cache))
    for b, n in enumerate(lengths):
        where = case._slots(b, 0, n)
        _fp8_bytes_into(k_cache8, where, keys8[b][:n])
        _fp8_bytes_into(v_cache8, where, values8[b][:n])
    k_new8 = torch.stack([k[n:] for k, n in zip(keys8, lengths)])
    v_new8 = torch.stack([v[n:] for v, n in zip(values8, lengths)])
    descales = tuple(torch.rand(len(lengths), heads[1], generator=g, device="cuda") * 0.02 + 0.005 for _ in range(3))
    out, lse = fa_gen.attention_with_kvcache(q8, k_cache8, v_cache8, case.cache_seqlens, spec, k_new=k_new8,
                                             v_new=v_new8, page_table=case.page_table,
                                             cache_batch_idx=case.cache_batch_idx, q_descale=descales[0],
                                             k_descale=descales[1], v_descale=descales[2])
    for b, n in enumerate(lengths):
        _judge(spec, out[b:b + 1], lse[b:b + 1], q8[b:b + 1], keys8[b][None], values8[b][None],
               tuple(d[b:b + 1] for d in descales))
        where = case._slots(b, n, n + seqlen_new)
        assert torch.equal(k_cache8.view(torch.uint8)[where], k_new8[b].view(torch.uint8)), f"sequence {b}'s keys"
        assert torch.equal(v_cache8.view(torch.uint8)[where], v_new8[b].view(torch.uint8)), f"sequence {b}'s values"
