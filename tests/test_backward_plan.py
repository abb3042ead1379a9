"""L0: the backward's per-call schedule under mask expressions (query tiles per key tile,
fa_gen.variant.tiles.query_tile_lists; plans, fa_gen.backward_plan), without a GPU.

Soundness over hypothesis shapes, GQA groups and masks (shipped and random): every visible
(query, key) pair is in a listed tile pair of its K/V head's row, every tile pair listed
without the element-mask flag is visible in full, and each entry's turn counts the lower key
tiles that list the same (query head, query tile).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_gen.backward import Backward
from fa_gen.backward_plan import make_backward_plan
from fa_gen.errors import InputError
from fa_gen.plan import make_plan
from fa_gen.reference import visibility
from fa_gen.runtime import BuildInfo, resolve_spec
from fa_gen.spec_load import load_spec
from fa_gen.variant import Role
from fa_gen.variant.tiles import classify_tiles, query_tile_lists

from .variant_grammar import INPUTS, conditions, parse_or_reject, random_tensors


def _decode(row: torch.Tensor, num_m: int):
    """[(g, m_block, masked, turn)] of one list row."""
    n_visit = int(row[0])
    width = (row.numel() - 1) // 2
    entries, turns = row[1:1 + width].tolist(), row[1 + width:].tolist()
    assert entries[n_visit:] == [-1] * (width - n_visit) and turns[n_visit:] == [-1] * (width - n_visit)
    return [((e >> 1) // num_m, (e >> 1) % num_m, bool(e & 1), t) for e, t in zip(entries[:n_visit], turns)]


def check_lists(visible: torch.Tensor, lists: torch.Tensor, heads_kv: int, tile_m: int, tile_n: int) -> None:
    """`visible` (batch, heads_q, seqlen_q, seqlen_k) against the lists made for it."""
    batch, heads_q, seqlen_q, seqlen_k = visible.shape
    group = heads_q // heads_kv
    num_m, num_n = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    assert lists.shape[2] == num_n and lists.shape[3] == 1 + 2 * (group * num_m + 1)
    listed = {}
    for b in range(batch):
        for hk in range(heads_kv):
            row_block = lists[min(b, lists.shape[0] - 1), min(hk, lists.shape[1] - 1)]
            for n in range(num_n):
                entries = _decode(row_block[n], num_m)
                assert len({(g, m) for g, m, _, _ in entries}) == len(entries), "a tile pair listed twice"
                heads = [g for g, _, _, _ in entries]
                assert heads == sorted(heads), "the query heads of a row come in order"
                for g, m, masked, turn in entries:
                    listed[(b, hk * group + g, m, n)] = (masked, turn)
    for (b, h, m, n), (masked, turn) in listed.items():
        tile = visible[b, h, m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n]
        if not masked:
            assert (n + 1) * tile_n <= seqlen_k and bool(tile.all()), f"tile ({m}, {n}) of head {h} is not all visible"
        lower = sum(1 for k in range(n) if (b, h, m, k) in listed)
        assert turn == lower, f"turn {turn} of ({m}, {n}) head {h}; {lower} lower key tiles visit it"
    for b, h, i, j in visible.nonzero().tolist():
        assert (b, h, i // tile_m, j // tile_n) in listed, f"visible ({i}, {j}) of head {h} in no listed tile"


tiles = st.sampled_from([(16, 8), (16, 32), (64, 128), (32, 16)])
shapes = st.tuples(st.integers(1, 2), st.integers(1, 90), st.integers(1, 90), st.integers(1, 3), st.integers(1, 3))


def _lists(spec_mask, decls, values, batch, heads_q, heads_kv, seqlen_q, seqlen_k, tile):
    codes = classify_tiles(spec_mask, decls, values, batch=batch, heads_q=heads_q, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, tile_m=tile[0], tile_n=tile[1])
    return query_tile_lists(codes, seqlen_k, tile[1], heads_q // heads_kv)


SHIPPED_MASKS = {"sliding_window_causal": {"window": 17}, "chunked_causal": {"chunk": 24},
                 "attention_sinks": {"window": 20, "sink_tokens": 3}, "document": None, "prefix_lm": None}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(SHIPPED_MASKS)), shape=shapes, tile=tiles, seed=st.integers(0, 2**31 - 1))
def test_query_tile_lists_of_shipped_masks_are_sound(name, shape, tile, seed):
    spec = resolve_spec(name)
    batch, seqlen_q, seqlen_k, heads_kv, group = shape
    heads_q = heads_kv * group
    generator = torch.Generator().manual_seed(seed)
    values = SHIPPED_MASKS[name] or _tensor_values(spec, batch, seqlen_q, seqlen_k, generator)
    lists = _lists(spec.mask_tree, spec.inputs, values, batch, heads_q, heads_kv, seqlen_q, seqlen_k, tile)
    visible = visibility(spec, seqlen_q, seqlen_k, batch=batch, heads_q=heads_q, inputs=values)
    check_lists(visible, lists, heads_kv, *tile)


def _tensor_values(spec, batch, seqlen_q, seqlen_k, generator):
    if spec.name == "document":
        ids = torch.randint(0, 3, (batch, max(seqlen_q, seqlen_k)), generator=generator).sort(-1).values.int()
        return {"q_doc": ids[:, :seqlen_q].contiguous(), "kv_doc": ids[:, :seqlen_k].contiguous()}
    return {"prefix_len": torch.randint(0, seqlen_k + 1, (batch,), generator=generator).int()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(text=conditions(2), shape=shapes, tile=tiles, seed=st.integers(0, 2**31 - 1))
def test_query_tile_lists_of_random_masks_are_sound(text, shape, tile, seed):
    """Masks that read b, h (per-head lists), document ids and tables, from the test grammar."""
    from fa_gen.variant.emit_torch import emit_torch

    tree = parse_or_reject(text, Role.MASK)
    batch, seqlen_q, seqlen_k, heads_kv, group = shape
    heads_q = heads_kv * group
    values = random_tensors(torch.Generator().manual_seed(seed), batch, heads_q, seqlen_q, seqlen_k)
    lists = _lists(tree, INPUTS, values, batch, heads_q, heads_kv, seqlen_q, seqlen_k, tile)
    env = {**values, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads_q": heads_q, "w": 3, "n": 2, "s": 0.5}
    for name, length, axis in (("b", batch, 0), ("h", heads_q, 1), ("q_idx", seqlen_q, 2), ("kv_idx", seqlen_k, 3)):
        view = [1, 1, 1, 1]
        view[axis] = length
        env[name] = torch.arange(length).view(view)
    visible = emit_torch(tree)(env).expand(batch, heads_q, seqlen_q, seqlen_k)
    check_lists(visible, lists, heads_kv, *tile)


def test_backward_plan_holds_inputs_then_the_lists():
    spec = resolve_spec("document")
    q, k = torch.randn(2, 70, 4, 128), torch.randn(2, 90, 2, 128)
    ids_q, ids_k = torch.zeros(2, 70, dtype=torch.int32), torch.zeros(2, 90, dtype=torch.int32)
    plan = make_backward_plan(spec, (64, 128), q, k, {"q_doc": ids_q, "kv_doc": ids_k})
    kv_doc, q_doc, lists = plan.arguments   # inputs in declared (sorted) order, then the lists
    assert kv_doc is ids_k and q_doc is ids_q
    num_m, num_n, group = 2, 1, 2
    assert lists.shape == (2, 1, num_n, 1 + 2 * (group * num_m + 1)) and lists.dtype == torch.int32
    plan.check_call(spec, (64, 128), q, k, backward=True)
    with pytest.raises(InputError, match="K/V heads"):
        plan.check_call(spec, (64, 128), q, torch.randn(2, 90, 4, 128), backward=True)
    with pytest.raises(InputError, match="made for the backward"):
        plan.check_call(spec, (64, 128), q, k)   # as the forward would call it
    with pytest.raises(InputError, match="q_doc"):
        make_backward_plan(spec, (64, 128), q, k, {"kv_doc": ids_k})


def _backward(name, arch="sm_90a"):
    from fa_gen.backward import backward_family

    spec = resolve_spec(name)
    info = BuildInfo(arch=arch, family=backward_family(spec, arch), entry_dir=None, source_filename="",
                     seconds=0.0, compiled=False)
    return Backward(spec, arch, function=None, info=info)


@pytest.mark.parametrize("arch, tiles", [("sm_90a", (64, 128)), ("sm_80", (64, 128))])
def test_backward_plans_use_the_backward_kernels_tiles(arch, tiles):
    bwd = _backward("chunked_causal", arch)
    q = torch.randn(1, 300, 2, 128)
    plan = bwd.plan(q, q, {"chunk": 100})
    assert plan.tiles == tiles and plan.arguments[0] == 100
    assert plan.arguments[1].shape[2] == -(-300 // tiles[1])


def test_backward_refuses_a_forward_plan_and_inputs_with_a_plan():
    bwd = _backward("chunked_causal")
    q = torch.randn(1, 64, 2, 128)
    forward_plan = make_plan(bwd.spec, (128, 128), q, q, {"chunk": 8})
    with pytest.raises(InputError, match="made for the forward"):
        bwd._extra_arguments(q, q, None, forward_plan)
    with pytest.raises(InputError, match="not both"):
        bwd._extra_arguments(q, q, {"chunk": 8}, bwd.plan(q, q, {"chunk": 8}))
    with pytest.raises(InputError, match="multiple of heads"):
        bwd.plan(q, torch.randn(1, 64, 3, 128))


def test_backward_of_a_spec_without_inputs_or_mask_takes_no_extra_arguments():
    bwd = _backward("causal_bf16_d128")
    q = torch.randn(1, 64, 2, 128)
    assert bwd._extra_arguments(q, q, None, None) == ()
    softcap = _backward("softcap")
    assert softcap._extra_arguments(q, q, None, None) == (30.0,)   # a scalar's default
    assert softcap._extra_arguments(q, q, {"softcap": 5.0}, None) == (5.0,)


def test_per_head_masks_keep_a_list_per_kv_head():
    spec = load_spec({"name": "per_head", "dtype": "bf16", "head_dim": 64,
                      "mask": {"expr": "kv_idx <= q_idx + h"}})
    codes = classify_tiles(spec.mask_tree, (), None, batch=1, heads_q=6, seqlen_q=40, seqlen_k=40,
                           tile_m=16, tile_n=16)
    lists = query_tile_lists(codes, 40, 16, group=3)
    assert lists.shape[:3] == (1, 2, 3)
    visible = visibility(spec, 40, 40, batch=1, heads_q=6)
    check_lists(visible, lists, 2, 16, 16)
