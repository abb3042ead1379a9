"""L0: call plans (fa_gen.plan) and the query-tile order, without a GPU."""

from __future__ import annotations

import pytest
import torch

from fa_gen.errors import InputError
from fa_gen.plan import make_plan, reads_tensors, uneven_rows
from fa_gen.runtime import resolve_spec
from fa_gen.variant.tiles import LIST_HEADER, classify_tiles, key_tile_lists, visit_order


def _qk(batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim=128):
    return torch.randn(batch, seqlen_q, heads_q, dim), torch.randn(batch, seqlen_k, heads_kv, dim)


def test_visit_order_goes_head_by_head_longest_query_tiles_first():
    spec = resolve_spec("chunked_causal")
    codes = classify_tiles(spec.mask_tree, spec.inputs, {"chunk": 64}, batch=2, heads_q=3, seqlen_q=200,
                           seqlen_k=200, tile_m=32, tile_n=16)
    lists = key_tile_lists(codes, 200, 16)
    order = visit_order(lists, 2, 3).tolist()
    num_m = lists.shape[2]
    assert sorted(order) == list(range(2 * 3 * num_m))
    heads = [t // num_m for t in order]
    assert heads == sorted(heads)
    for a, b in zip(order, order[1:]):
        if a // num_m == b // num_m:
            va, vb = int(lists[0, 0, a % num_m, 1]), int(lists[0, 0, b % num_m, 1])
            assert va > vb or (va == vb and a < b)


def test_plan_holds_checked_inputs_then_lists_and_order():
    spec = resolve_spec("document")
    q, k = _qk(2, 70, 90, 4, 2)
    ids_q = torch.zeros(2, 70, dtype=torch.int32)
    ids_k = torch.zeros(2, 90, dtype=torch.int32)
    plan = make_plan(spec, (64, 32), q, k, {"q_doc": ids_q, "kv_doc": ids_k})
    kv_doc, q_doc, lists, order, uneven = plan.arguments  # inputs in declared (sorted) order, then the schedule
    assert kv_doc is ids_k and q_doc is ids_q
    assert lists.shape == (2, 1, 2, LIST_HEADER + 3 + 2) and order.shape == (2 * 4 * 2,)
    assert uneven == 0  # one document: every query tile sees all of its causal keys
    assert reads_tensors(spec) and not reads_tensors(resolve_spec("chunked_causal"))
    with pytest.raises(InputError, match="q_doc"):
        make_plan(spec, (64, 32), q, k, {"kv_doc": ids_k})


def test_plan_refuses_a_call_it_was_not_made_for():
    spec = resolve_spec("sliding_window_causal")
    q, k = _qk(1, 40, 40, 2, 2)
    plan = make_plan(spec, (64, 32), q, k, {"window": 8})
    plan.check_call(spec, (64, 32), q, k)
    with pytest.raises(InputError, match="made for"):
        plan.check_call(spec, (64, 32), *_qk(1, 41, 40, 2, 2))
    with pytest.raises(InputError, match="another kernel"):
        plan.check_call(spec, (128, 32), q, k)
    with pytest.raises(InputError, match="another kernel"):
        plan.check_call(resolve_spec("chunked_causal"), (64, 32), q, k)


def test_uneven_rows_tell_causal_like_masks_from_windows():
    def uneven(name, values, seqlen=4096):
        spec = resolve_spec(name)
        codes = classify_tiles(spec.mask_tree, spec.inputs, values, batch=1, heads_q=1, seqlen_q=seqlen,
                               seqlen_k=seqlen, tile_m=128, tile_n=128)
        return uneven_rows(key_tile_lists(codes, seqlen, 128))
    assert uneven("chunked_causal", {"chunk": 1024}) == 1
    assert uneven("sliding_window_causal", {"window": 512}) == 0
