"""Interval analysis and tile classification: sound by brute force, and tight where it matters (L0, CPU).

Soundness is checked by enumerating every point of small regions (index ranges inside
[0, 40), a few batch entries and heads): the value of every random expression lies in
its interval, and a tile is never skipped while it holds a visible element nor left
unmasked while it holds a masked one. Tightness is checked on the library's masks,
where a classifier that always answered MAYBE would be sound and useless.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fa_gen.spec_load import load_spec
from fa_gen.paths import specs_dir
from fa_gen.variant import Role, parse
from fa_gen.variant.emit_torch import emit_torch
from fa_gen.variant.intervals import Interval, Tri, bounds, classify, tri_codes
from fa_gen.variant.tiles import classify_tiles
from fa_gen.variant.tree import Compare, Const, Type
from tests.variants import variant_library_paths
from tests.variant_grammar import INPUTS, conditions, float_exprs, int_exprs, parse_or_reject, random_tensors

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCALARS = {"w": 3, "n": -2, "s": 0.75}
LIBRARY = variant_library_paths()


# --- a random region and every point in it --------------------------------------------------------

@st.composite
def regions(draw):
    """Sizes, a sub-range of each index, and values for every input."""
    sizes = {"batch": draw(st.integers(1, 3)), "heads_q": draw(st.integers(1, 3)),
             "seqlen_q": draw(st.integers(1, 40)), "seqlen_k": draw(st.integers(1, 40))}
    ranges = {}
    for name, size in (("b", "batch"), ("h", "heads_q"), ("q_idx", "seqlen_q"), ("kv_idx", "seqlen_k")):
        lo = draw(st.integers(0, sizes[size] - 1))
        ranges[name] = (lo, draw(st.integers(lo, sizes[size] - 1)))
    scalars = {"w": draw(st.integers(1, 9)), "n": draw(st.integers(-5, 5)), "s": draw(st.floats(-2, 2))}
    seed = draw(st.integers(0, 2 ** 31))
    return sizes, ranges, scalars, seed


def _env(sizes, ranges, scalars, seed):
    """(interval env, brute-force env over every point of the region)."""
    tensors = random_tensors(torch.Generator().manual_seed(seed), sizes["batch"], sizes["heads_q"],
                             sizes["seqlen_q"], sizes["seqlen_k"])
    intervals = {n: Interval.point(v) for n, v in scalars.items()}
    intervals.update({n: Interval.point(sizes[n]) for n in ("seqlen_q", "seqlen_k", "heads_q")})
    intervals.update({n: Interval.of(*r) for n, r in ranges.items()})
    # Whole-tensor bounds are sound for any read (per-tile ones are tested through classify_tiles).
    intervals.update({n: Interval.of(t.double().min(), t.double().max()) for n, t in tensors.items()})
    points = {**scalars, **tensors, "seqlen_q": sizes["seqlen_q"], "seqlen_k": sizes["seqlen_k"],
              "heads_q": sizes["heads_q"]}
    for axis, name in enumerate(("b", "h", "q_idx", "kv_idx")):
        shape = [1, 1, 1, 1]
        lo, hi = ranges[name]
        shape[axis] = hi - lo + 1
        points[name] = torch.arange(lo, hi + 1).view(shape)
    return intervals, points


def _check_contains(result: Interval, values: torch.Tensor, tolerance: float = 0.0) -> None:
    lo, hi = float(result.lo), float(result.hi)
    finite = values[~torch.isnan(values)]
    assert bool((finite >= lo - tolerance).all()) and bool((finite <= hi + tolerance).all()), (lo, hi, finite)


def _check_truth(tree, intervals, points) -> None:
    code = Tri(int(tri_codes(bounds(tree, intervals))))
    values = emit_torch(tree)(points)
    if code is Tri.NEVER:
        assert not bool(values.any()), "NEVER, yet true somewhere in the region"
    if code is Tri.ALWAYS:
        assert bool(values.all()), "ALWAYS, yet false somewhere in the region"


# --- soundness of every operator ---------------------------------------------------------------------

@FAST
@given(text=int_exprs(), region=regions())
def test_int_bounds_contain_every_value(text, region):
    tree = parse_or_reject(f"({text}) >= 0", Role.MASK)
    assume(isinstance(tree, Compare))  # not folded away to a constant
    intervals, points = _env(*region)
    result = bounds(tree.left, intervals)
    biggest = max(abs(float(result.lo)), abs(float(result.hi)))
    assume(math.isinf(biggest) or biggest < 2 ** 50)  # finite bounds this small rule out int64 overflow
    _check_contains(result, emit_torch(tree.left)(points).double())


@FAST
@given(text=conditions(), region=regions())
def test_condition_tri_state_is_sound(text, region):
    tree = parse_or_reject(text, Role.MASK)
    _check_truth(tree, *_env(*region))


@FAST
@given(text=float_exprs(), region=regions(), scores=st.tuples(st.floats(-8, 8), st.floats(0, 8)))
def test_float_bounds_contain_every_value(text, region, scores):
    tree = parse_or_reject(text, Role.SCORE_MOD)
    intervals, points = _env(*region)
    low, width = scores
    intervals["score"] = Interval.of(low, low + width)
    points["score"] = torch.linspace(low, low + width, 7, dtype=torch.float64).view(7, 1, 1, 1, 1)
    result = bounds(tree, intervals)
    values = emit_torch(tree)(points)
    # Library functions may round a last bit differently at an interval's end and inside it.
    scale = max([1.0, *(abs(float(x)) for x in (result.lo, result.hi) if math.isfinite(float(x)))])
    _check_contains(result, values, tolerance=1e-12 * scale)


# --- rules worth naming --------------------------------------------------------------------------------

def _tri(text: str, **ranges) -> Tri:
    inputs = INPUTS
    return classify(parse(text, Role.MASK, inputs), {n: Interval.of(*r) for n, r in ranges.items()})


@pytest.mark.parametrize("text, ranges, expected", [
    ("kv_idx <= q_idx", dict(q_idx=(16, 31), kv_idx=(0, 15)), Tri.ALWAYS),
    ("kv_idx <= q_idx", dict(q_idx=(0, 15), kv_idx=(16, 31)), Tri.NEVER),
    ("kv_idx <= q_idx", dict(q_idx=(0, 15), kv_idx=(0, 15)), Tri.MAYBE),
    # floor division of negatives: (q - kv) in [-15, -1] // 16 is -1 throughout
    ("(q_idx - kv_idx) // 16 == -1", dict(q_idx=(0, 14), kv_idx=(15, 15)), Tri.ALWAYS),
    # modulo inside one period is exact; across a period boundary it is not
    ("q_idx % 8 >= 4", dict(q_idx=(12, 15)), Tri.ALWAYS),
    ("q_idx % 8 >= 4", dict(q_idx=(6, 9)), Tri.MAYBE),
    ("abs(q_idx - kv_idx) < 4", dict(q_idx=(10, 12), kv_idx=(9, 11)), Tri.ALWAYS),
    ("(q_idx - kv_idx) ** 2 >= 0", dict(q_idx=(0, 9), kv_idx=(0, 9)), Tri.ALWAYS),
    ("(q_idx - kv_idx) ** 2 < 50", dict(q_idx=(0, 9), kv_idx=(0, 9)), Tri.MAYBE),  # an even power of [-9, 9]
    # a divisor with no upper bound: floor of a small negative over a huge divisor is -1, not 0
    ("(q_idx - kv_idx) // w == -1", dict(q_idx=(0, 0), kv_idx=(1, 5), w=(10, math.inf)), Tri.ALWAYS),
    ("where(q_idx < 8, kv_idx, 100) < 50", dict(q_idx=(0, 7), kv_idx=(0, 40)), Tri.ALWAYS),
    ("min(q_idx, kv_idx) >= 3 or max(q_idx, kv_idx) < 3", dict(q_idx=(3, 9), kv_idx=(5, 9)), Tri.ALWAYS),
    # a name the environment does not bound: nothing is known
    ("kv_idx < seqlen_k", dict(kv_idx=(0, 9)), Tri.MAYBE),
    ("qdoc[b, q_idx] == 1", dict(), Tri.MAYBE),
])
def test_named_rules(text, ranges, expected):
    assert _tri(text, **ranges) is expected


def test_division_by_an_interval_around_zero_is_unbounded():
    tree = parse("score / s", Role.SCORE_MOD, INPUTS)
    result = bounds(tree, {"score": Interval.of(1, 2), "s": Interval.of(-1, 1)})
    assert (float(result.lo), float(result.hi)) == (-math.inf, math.inf)


def test_classify_wants_one_region():
    grid = {"q_idx": Interval(torch.tensor([0.0, 16.0]), torch.tensor([15.0, 31.0])), "kv_idx": Interval.of(0, 15)}
    with pytest.raises(ValueError, match="0-d bounds"):
        classify(parse("kv_idx <= q_idx", Role.MASK), grid)


# --- per-call tile classification ------------------------------------------------------------------------

def _visible(mask, sizes, values) -> torch.Tensor:
    """(B, H, Lq, Lk) truth of `mask` at every element, by the torch emitter."""
    env = {**values, **{k: sizes[k] for k in ("seqlen_q", "seqlen_k", "heads_q")}}
    for axis, (name, size) in enumerate((("b", "batch"), ("h", "heads_q"), ("q_idx", "seqlen_q"),
                                         ("kv_idx", "seqlen_k"))):
        shape = [1, 1, 1, 1]
        shape[axis] = sizes[size]
        env[name] = torch.arange(sizes[size]).view(shape)
    return emit_torch(mask)(env).expand(sizes["batch"], sizes["heads_q"], sizes["seqlen_q"], sizes["seqlen_k"])


def _check_tiles(codes, visible, tile_m, tile_n) -> None:
    batch, heads, seqlen_q, seqlen_k = visible.shape
    for m in range(codes.shape[2]):
        for n in range(codes.shape[3]):
            block = visible[:, :, m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n]
            code = codes[:, :, m, n].expand(batch, heads)
            per_bh = block.flatten(2)
            assert not bool(per_bh.any(-1)[code == Tri.NEVER].any()), f"skipped tile ({m}, {n}) has a visible key"
            assert bool(per_bh.all(-1)[code == Tri.ALWAYS].all()), f"unmasked tile ({m}, {n}) has a masked key"


@FAST
@given(text=conditions(), region=regions(), tiles=st.tuples(st.integers(1, 16), st.integers(1, 16)))
def test_tile_classes_are_sound(text, region, tiles):
    mask = parse_or_reject(text, Role.MASK)
    sizes, _, scalars, seed = region
    tensors = random_tensors(torch.Generator().manual_seed(seed), sizes["batch"], sizes["heads_q"],
                             sizes["seqlen_q"], sizes["seqlen_k"])
    values = {**scalars, **tensors}
    tile_m, tile_n = tiles
    codes = classify_tiles(mask, INPUTS, values, tile_m=tile_m, tile_n=tile_n, **sizes)
    _check_tiles(codes, _visible(mask, sizes, values), tile_m, tile_n)


# --- tightness on the library ----------------------------------------------------------------------------

def _exact(visible, tile_m, tile_n) -> torch.Tensor:
    """The classification a perfect analysis would give, per (b, h, m, n)."""
    b, h, sq, sk = visible.shape
    pad = torch.zeros(b, h, -(-sq // tile_m) * tile_m, -(-sk // tile_n) * tile_n, dtype=torch.int8)
    any_pad, all_pad = pad.clone(), pad.clone() + 1
    any_pad[:, :, :sq, :sk] = visible.to(torch.int8)
    all_pad[:, :, :sq, :sk] = visible.to(torch.int8)
    blocks = (b, h, pad.shape[2] // tile_m, tile_m, pad.shape[3] // tile_n, tile_n)
    any_v = any_pad.view(blocks).amax(dim=(3, 5)).bool()
    all_v = all_pad.view(blocks).amin(dim=(3, 5)).bool()
    return torch.where(~any_v, Tri.NEVER, torch.where(all_v, Tri.ALWAYS, Tri.MAYBE)).to(torch.int8)


@pytest.mark.parametrize("name, values", [
    ("sliding_window_causal", {"window": 20}),
    ("attention_sinks", {"window": 24, "sink_tokens": 5}),
    ("chunked_causal", {"chunk": 32}),
])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(100, 100), (70, 130), (130, 70)])
def test_index_masks_are_classified_exactly(name, values, seqlen_q, seqlen_k):
    spec = load_spec(LIBRARY[name], check_archs=False)
    sizes = dict(batch=1, heads_q=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    codes = classify_tiles(spec.mask_tree, spec.inputs, values, tile_m=16, tile_n=8, **sizes)
    if name == "attention_sinks":
        # Exact except where a tile spans both the sink keys and the window's far edge.
        _check_tiles(codes, _visible(spec.mask_tree, sizes, values), 16, 8)
        assert (codes == Tri.NEVER).any() and (codes == Tri.ALWAYS).any()
        return
    assert torch.equal(codes, _exact(_visible(spec.mask_tree, sizes, values), 16, 8))


def test_document_mask_uses_per_tile_ids():
    spec = load_spec(LIBRARY["document"], check_archs=False)
    docs = torch.tensor([[0] * 32 + [1] * 32], dtype=torch.int32)
    codes = classify_tiles(spec.mask_tree, spec.inputs, {"q_doc": docs, "kv_doc": docs},
                           batch=1, heads_q=4, seqlen_q=64, seqlen_k=64, tile_m=16, tile_n=16)
    assert codes.shape == (1, 1, 4, 4)  # per batch entry (the mask reads b), shared by every head
    never, maybe, always = Tri.NEVER, Tri.MAYBE, Tri.ALWAYS
    expected = torch.tensor([[maybe, never, never, never],
                             [always, maybe, never, never],
                             [never, never, maybe, never],
                             [never, never, always, maybe]], dtype=torch.int8)
    assert torch.equal(codes[0, 0], expected)


def test_prefix_lm_classifies_per_batch_entry():
    spec = load_spec(LIBRARY["prefix_lm"], check_archs=False)
    prefix = torch.tensor([0, 40], dtype=torch.int32)
    sizes = dict(batch=2, heads_q=1, seqlen_q=64, seqlen_k=64)
    codes = classify_tiles(spec.mask_tree, spec.inputs, {"prefix_len": prefix}, tile_m=16, tile_n=16, **sizes)
    exact = _exact(_visible(spec.mask_tree, sizes, {"prefix_len": prefix}), 16, 16)
    assert torch.equal(codes, exact)
    assert not torch.equal(codes[0], codes[1])


def test_tile_classification_checks_inputs():
    spec = load_spec(LIBRARY["prefix_lm"], check_archs=False)
    from fa_gen.errors import InputError

    with pytest.raises(InputError, match="below its declared min 0"):
        classify_tiles(spec.mask_tree, spec.inputs, {"prefix_len": torch.tensor([-1], dtype=torch.int32)},
                       batch=1, heads_q=1, seqlen_q=8, seqlen_k=8, tile_m=4, tile_n=4)


def test_constant_masks_need_no_names():
    tree = parse("True", Role.MASK)
    assert isinstance(tree, Const) and tree.type is Type.BOOL
    codes = classify_tiles(tree, (), None, batch=2, heads_q=2, seqlen_q=10, seqlen_k=5, tile_m=4, tile_n=4)
    assert codes.shape == (1, 1, 3, 2) and bool((codes == Tri.ALWAYS).all())
