"""L0: the variant benchmark's table (bench/variants.py) is consistent, on CPU in seconds.

Every row names a spec that loads, builds inputs that bind to it, and gives FlexAttention a
mask_mod/score_mod (and FlashAttention-4 arguments) meaning the same function as fa_gen's
float64 reference; the visible-pair count behind TFLOP/s is exact. Small shapes, with the
table's window/chunk/sink sizes shrunk so that every mask bites at them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fa_gen.check import Shape
from fa_gen.reference import attention_reference, visibility
from fa_gen.variant.bind import bind_inputs

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_forward  # noqa: E402
import variants as table  # noqa: E402

SMALL = Shape(batch=2, seqlen_q=256, seqlen_k=256, heads_q=2, heads_kv=2)
NAMES = [v.name for v in table.VARIANTS]


@pytest.fixture
def small_sizes(monkeypatch):
    """The table's sizes scaled to SMALL (the inputs read them when called)."""
    monkeypatch.setattr(table, "WINDOW", 37)
    monkeypatch.setattr(table, "CHUNK", 64)
    monkeypatch.setattr(table, "SINK_TOKENS", 3)


def _sizes(shape: Shape) -> dict:
    return {"batch": shape.batch, "heads_q": shape.heads_q, "seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k}


def test_every_shipped_expression_spec_has_a_row():
    from fa_gen.generate import shipped_specs

    shipped = {spec.name for spec in shipped_specs() if spec.uses_expressions}
    assert shipped <= {v.spec for v in table.VARIANTS}
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_spec_loads_and_inputs_bind_at_every_benchmark_shape(name):
    variant = table.BY_NAME[name]
    spec = table.load_variant_spec(variant)
    assert spec.uses_expressions
    for seqlen in map(int, bench_forward.VARIANT_SEQLENS.split(",")):
        shape = bench_forward.variant_shape(spec, seqlen)
        assert shape.batch * seqlen == bench_forward.TOKENS
        assert shape.heads_q * spec.head_dim_qk == bench_forward.HIDDEN
        bind_inputs(spec.inputs, variant.inputs(shape, "cpu"), _sizes(shape))


def _flex_dense_mask(mods: table.FlexMods, shape: Shape) -> torch.Tensor:
    """Flex's mask_mod on every (b, h, q, kv) at once, as broadcast index tensors."""
    b, h, q, kv = (torch.arange(n).view([-1 if i == axis else 1 for i in range(4)])
                   for axis, n in enumerate((shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k)))
    full = (shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k)
    if mods.mask_mod is None:
        return torch.ones(full, dtype=torch.bool)
    return mods.mask_mod(b, h, q, kv).expand(full)


@pytest.mark.parametrize("name", NAMES)
def test_flex_computes_the_reference(name, small_sizes):
    """FlexAttention (eager, float64, CPU) with the row's mods against fa_gen's float64 reference."""
    from torch.nn.attention.flex_attention import flex_attention

    variant = table.BY_NAME[name]
    spec = table.load_variant_spec(variant)
    shape = Shape(SMALL.batch, SMALL.seqlen_q, SMALL.seqlen_k, SMALL.heads_q, SMALL.heads_kv)
    inputs = variant.inputs(shape, "cpu")
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape.batch, shape.seqlen_q, shape.heads_q, spec.head_dim_qk, generator=generator,
                           dtype=torch.float64) for _ in range(3))
    program = table.flex_program(variant.flex(inputs, shape), shape, "cpu", flex=flex_attention, lse=True)
    out, lse = program(q, k, v)
    ref_out, ref_lse = attention_reference(q, k, v, spec, inputs=inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_visible_pairs_count_flex_mask(name, small_sizes):
    variant = table.BY_NAME[name]
    spec = table.load_variant_spec(variant)
    inputs = variant.inputs(SMALL, "cpu")
    dense = _flex_dense_mask(variant.flex(inputs, SMALL), SMALL)
    pairs = table.visible_pairs(spec, SMALL, inputs)
    assert pairs == int(dense.sum())
    # The masks bite at this size: neither everything nor the plain causal triangle (bar the kind masks).
    triangle = SMALL.batch * SMALL.heads_q * SMALL.seqlen_q * (SMALL.seqlen_q + 1) // 2
    if spec.mask_expr is not None:
        assert pairs != triangle and 0 < pairs < dense.numel()


def _fa4_visibility(kwargs: dict, shape: Shape) -> torch.Tensor:
    """(batch, seqlen, seqlen): FlashAttention-4's documented masking for these arguments
    (causal: key <= query; window_size (left, right): query - left <= key <= query + right;
    cu_seqlens: only keys of the query's own sequence in the flattened tokens)."""
    tokens = shape.batch * shape.seqlen_q
    i = torch.arange(tokens).view(-1, 1)
    j = torch.arange(tokens).view(1, -1)
    cu_seqlens = kwargs.get("cu_seqlens", torch.arange(0, tokens + 1, shape.seqlen_q))
    sequence = torch.bucketize(torch.arange(tokens), cu_seqlens.long(), right=True)
    seen = sequence.view(-1, 1) == sequence.view(1, -1)
    left, right = kwargs.get("window_size", (None, None))
    if kwargs.get("causal"):
        right = 0
    if right is not None:
        seen &= j <= i + right
    if left is not None:
        seen &= j >= i - left
    blocks = seen.view(shape.batch, shape.seqlen_q, shape.batch, shape.seqlen_q)
    return torch.stack([blocks[n, :, n] for n in range(shape.batch)])


@pytest.mark.parametrize("name", [v.name for v in table.VARIANTS if v.fa4 is not None])
def test_fa4_arguments_mask_the_same_keys(name, small_sizes):
    variant = table.BY_NAME[name]
    spec = table.load_variant_spec(variant)
    inputs = variant.inputs(SMALL, "cpu")
    kwargs = variant.fa4(inputs, SMALL)
    if spec.mask_expr is not None:
        expected = visibility(spec, SMALL.seqlen_q, SMALL.seqlen_k, batch=SMALL.batch, heads_q=SMALL.heads_q,
                              inputs=inputs)[:, 0]
    else:
        expected = visibility(spec, SMALL.seqlen_q, SMALL.seqlen_k).expand(SMALL.batch, -1, -1)
    assert torch.equal(_fa4_visibility(kwargs, SMALL), expected)
    if "cu_seqlens" in kwargs:
        lengths = kwargs["cu_seqlens"].diff()
        assert int(lengths.max()) == kwargs["max_seqlen"] and kwargs["cu_seqlens"].dtype == torch.int32


def test_visible_pairs_at_a_benchmark_shape_match_closed_forms():
    def count(name, seqlen):
        variant = table.BY_NAME[name]
        spec = table.load_variant_spec(variant)
        shape = bench_forward.variant_shape(spec, seqlen)
        return table.visible_pairs(spec, shape, variant.inputs(shape, "cpu")), shape

    pairs, shape = count("softcap", 1024)
    assert pairs == shape.batch * shape.heads_q * 1024 * 1025 // 2
    pairs, shape = count("sliding_window_causal", 4096)
    assert pairs == shape.batch * shape.heads_q * sum(min(i + 1, table.WINDOW) for i in range(4096))
    pairs, shape = count("document", 1024)
    length = 1024 // table.DOCUMENTS
    assert pairs == shape.batch * shape.heads_q * table.DOCUMENTS * length * (length + 1) // 2
    pairs, shape = count("relative_bias", 1024)
    assert pairs == shape.batch * shape.heads_q * 1024 * 1024


def test_table_marks_cells_below_the_bars():
    variant = table.BY_NAME["softcap"]
    cell = {"variant": "softcap", "seqlen": 8192, "batch": 2, "heads": 16, "head_dim": 128,
            "results": [{"impl": "fa_gen", "family": "sm90", "tflops": 300.0}, {"impl": "flex", "tflops": 182.0},
                        {"impl": "fa4", "tflops": 268.0}]}
    cell["ratios"] = bench_forward.variant_ratios(cell, variant)
    assert cell["ratios"]["flex"]["meets"] and not cell["ratios"]["fa4"]["meets"]   # 1.12 < 1.3 for softcap
    unsupported = {"variant": "sink_logit", "seqlen": 1024, "batch": 16, "heads": 32, "head_dim": 64, "ratios": {},
                   "results": [{"impl": "fa_gen", "unsupported": "SpecError: ..."}, {"impl": "flex", "tflops": 100.0},
                               {"impl": "fa4", "tflops": 200.0}]}
    text = bench_forward.variant_table([cell, unsupported], {"softcap": {"flex": {"ok": False}}})
    rows = text.splitlines()[2:]
    assert "300 (sm90)" in rows[0] and "1.65 (check failed)" in rows[0] and "1.12 ✗ (< 1.3)" in rows[0]
    assert "unsupported" in rows[1]
