"""L0 (CPU): padded batches as packed (varlen) ones and back (fa_gen.integrations.padding)."""

import torch

from fa_gen.integrations import padding



def test_unpad_left_and_right_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    packing = padding.unpad_mask(mask, 5)
    assert packing.indices_k.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert packing.cu_seqlens_k.tolist() == [0, 3, 8, 10] and packing.cu_seqlens_k.dtype == torch.int32
    assert packing.indices_q is packing.indices_k and (packing.max_seqlen_q, packing.max_seqlen_k) == (5, 5)


def test_unpad_decode_step_takes_the_last_column_as_queries():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    packing = padding.unpad_mask(mask, 1)
    assert packing.indices_q.tolist() == [0, 1] and packing.cu_seqlens_q.tolist() == [0, 1, 2]
    assert packing.cu_seqlens_k.tolist() == [0, 2, 6] and (packing.max_seqlen_q, packing.max_seqlen_k) == (1, 4)


def test_gather_and_scatter_round_trip_through_a_transposed_view():
    x = torch.randn(3, 2, 5, 4).transpose(1, 2)  # (batch, seqlen, heads, d), as transformers' q arrives
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    packing = padding.unpad_mask(mask, 5)
    rows = padding.gather(x, packing.indices_q, 5)
    assert rows.shape == (10, 2, 4) and torch.equal(rows[0], x[0, 2])
    back = padding.scatter(rows, packing.indices_q, 3, 5)
    assert torch.equal(back[mask], x[mask]) and not back[~mask].any()


def test_scatter_is_differentiable():
    rows = torch.randn(4, 2, requires_grad=True)
    padding.scatter(rows, torch.tensor([1, 2, 5, 7]), 2, 4).sum().backward()
    assert torch.equal(rows.grad, torch.ones(4, 2))


def test_packed_from_position_ids():
    cu, longest = padding.packed_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    assert padding.packed_from_position_ids(torch.arange(7).view(1, -1) + 3) is None


def test_last_result_is_kept_per_tensor_and_version():
    calls = []
    memo = padding.LastResult(lambda t, n: calls.append(n) or n)
    mask = torch.ones(2, 3)
    memo(mask, 3), memo(mask, 3)
    assert calls == [3]
    memo(mask, 1)
    mask[0, 0] = 0  # changed in place: recomputed
    memo(mask, 1)
    memo(mask.clone(), 1)
    assert calls == [3, 1, 1, 1]
