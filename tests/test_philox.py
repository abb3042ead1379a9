"""L0: fa_gen.philox reproduces Random123's Philox4x32 known answers and maps dropout indices
as its docstring says (what the dropout kernels will be checked against bit for bit)."""

from __future__ import annotations

import random

import pytest
import torch

from fa_gen.philox import MASK32, _mulhilo, drop_threshold, dropout_keep, effective_p, philox4x32, rescale

# Random123 tests/kat_vectors: rounds, counter[4], key[2] -> output[4].
KNOWN_ANSWERS = [
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (MASK32,) * 4, (MASK32, MASK32), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


@pytest.mark.parametrize("rounds, counter, key, expected", KNOWN_ANSWERS)
def test_known_answers(rounds, counter, key, expected):
    out = philox4x32(torch.tensor(counter), torch.tensor(key), rounds)
    assert out.tolist() == list(expected)


def test_batched_equals_one_by_one():
    rng = random.Random(3)
    counters = [[rng.getrandbits(32) for _ in range(4)] for _ in range(50)]
    keys = [[rng.getrandbits(32) for _ in range(2)] for _ in range(50)]
    batched = philox4x32(torch.tensor(counters), torch.tensor(keys))
    for i, (c, k) in enumerate(zip(counters, keys)):
        assert batched[i].tolist() == philox4x32(torch.tensor(c), torch.tensor(k)).tolist()


def test_mulhilo_is_the_64_bit_product():
    rng = random.Random(7)
    b = [rng.getrandbits(32) for _ in range(1000)] + [0, 1, MASK32]
    for a in (0xD2511F53, 0xCD9E8D57, MASK32, 1):
        hi, lo = _mulhilo(a, torch.tensor(b))
        assert [(h << 32) | l for h, l in zip(hi.tolist(), lo.tolist())] == [a * x for x in b]


def test_rejects_other_dtypes():
    with pytest.raises(TypeError):
        philox4x32(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))


def test_keep_mask_mapping_and_rate():
    q = torch.arange(64).view(-1, 1)
    k = torch.arange(256).view(1, -1)
    keep = dropout_keep(seed=1234, offset=8, batch=1, head=3, heads_q=8, q_idx=q, kv_idx=k, p=0.25)
    # One Philox call per 4 x 4 block of queries (q, q + 1, q + 8, q + 9) and keys (k, k + 1,
    # k + 8, k + 9), a byte a score, written out element by element here.
    key = torch.tensor([1234, 0])
    for row in (0, 1, 5, 8, 9, 13, 16, 23, 40, 63):
        for col in (0, 1, 2, 7, 8, 9, 15, 100, 255):
            counter = torch.tensor([col // 16 * 4 + col % 8 // 2, row // 16 * 4 + row % 8 // 2, 1 * 8 + 3, 8])
            word = philox4x32(counter, key)[2 * (row % 2) + col // 8 % 2].item()
            value = (word >> (8 * (2 * (col % 2) + row // 8 % 2))) & 0xFF
            assert keep[row, col].item() == (value >= drop_threshold(0.25)), (row, col)
    # Queries 18, 19, 26, 27 times keys 36, 37, 44, 45: the sixteen bytes of one call.
    block = dropout_keep(1234, 8, 1, 3, 8, torch.tensor([[18], [19], [26], [27]]), torch.tensor([[36, 37, 44, 45]]),
                         0.25)
    words = philox4x32(torch.tensor([2 * 4 + 2, 4 + 1, 11, 8]), key)
    byte = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], -1)   # [word, byte]
    expected = torch.empty(4, 4, dtype=torch.bool)
    for i, row in enumerate((18, 19, 26, 27)):
        for j, col in enumerate((36, 37, 44, 45)):
            expected[i, j] = byte[2 * (row % 2) + col // 8 % 2, 2 * (col % 2) + row // 8 % 2] >= 64
    assert torch.equal(block, expected)
    # The call's four words hold sixteen different bytes: no score shares another's.
    assert sorted((2 * (r % 2) + c // 8 % 2, 2 * (c % 2) + r // 8 % 2) for r in (18, 19, 26, 27)
                  for c in (36, 37, 44, 45)) == [(w, b) for w in range(4) for b in range(4)]
    # 16384 Bernoulli(0.75) draws: the kept share within 5 standard deviations of 0.75.
    assert abs(keep.double().mean().item() - 0.75) < 5 * (0.75 * 0.25 / keep.numel()) ** 0.5
    # Same state, same mask; another offset, seed or head, another mask.
    again = dropout_keep(1234, 8, 1, 3, 8, q, k, 0.25)
    assert torch.equal(keep, again)
    for other in (dropout_keep(1234, 9, 1, 3, 8, q, k, 0.25), dropout_keep(1235, 8, 1, 3, 8, q, k, 0.25),
                  dropout_keep(1234, 8, 1, 4, 8, q, k, 0.25), dropout_keep(1234, 8 + (1 << 32), 1, 3, 8, q, k, 0.25)):
        assert not torch.equal(keep, other)


def test_threshold_and_rescale():
    """p is rounded to the nearest multiple of 1/256 (the mask draws a byte a score), at most
    255/256; the rescale is 1 / (1 - p') for that p'."""
    assert drop_threshold(0.0) == 0 and rescale(0.0) == 1.0
    assert drop_threshold(0.5) == 128 and rescale(0.5) == 2.0
    assert drop_threshold(0.25) == 64 and effective_p(0.25) == 0.25
    assert drop_threshold(0.1) == 26 and rescale(0.1) == 256 / 230  # round(25.6)
    assert drop_threshold(1 / 512 - 1e-9) == 0 and drop_threshold(1 / 512) == 1
    assert drop_threshold(0.999) == 255 and rescale(0.999) == 256.0
    for p in (0.01, 0.1, 0.3, 0.9):
        assert abs(effective_p(p) - p) <= 1 / 512
        assert abs(rescale(p) * (1 - effective_p(p)) - 1) < 1e-15
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError):
            drop_threshold(p)


def test_reference_dropout_is_the_mask_times_the_probabilities():
    from fa_gen.philox import Dropout
    from fa_gen.reference import attention_reference
    from fa_gen.runtime import resolve_spec

    spec = resolve_spec("causal_bf16_d128")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 37, 4, 128, generator=g, dtype=torch.float64) for _ in range(3))
    drop = Dropout(0.3, seed=77, offset=12)
    out, lse = attention_reference(q, k, v, spec, dropout=drop)
    plain_out, plain_lse = attention_reference(q, k, v, spec)
    assert torch.equal(lse, plain_lse)  # the LSE is the undropped one
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * spec.softmax_scale
    visible = torch.ones(37, 37, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1)
    index = torch.arange(37)
    keep = dropout_keep(77, 12, torch.arange(2).view(2, 1, 1, 1), torch.arange(4).view(1, 4, 1, 1), 4,
                        index.view(1, 1, 37, 1), index.view(1, 1, 1, 37), 0.3)
    expected = torch.einsum("bhqk,bkhd->bqhd", probs * keep * rescale(0.3), v)
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, plain_out)
    # p = 0 is no dropout at all.
    assert torch.equal(attention_reference(q, k, v, spec, dropout=Dropout(0.0, 77, 12))[0], plain_out)


def test_dropout_is_unbiased_over_seeds():
    """The mean output over 400 seeds approaches the undropped output (each kept probability is
    rescaled by 1 / (1 - p)): within 5 standard errors of the per-seed spread, everywhere."""
    from fa_gen.philox import Dropout
    from fa_gen.reference import attention_reference
    from fa_gen.runtime import resolve_spec

    spec = resolve_spec("full_bf16_d128")
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 8, 2, 128, generator=g, dtype=torch.float64) for _ in range(3))
    plain, _ = attention_reference(q, k, v, spec)
    draws = torch.stack([attention_reference(q, k, v, spec, dropout=Dropout(0.2, seed, 0))[0] for seed in range(400)])
    standard_error = draws.std(dim=0) / 400 ** 0.5
    assert bool(((draws.mean(dim=0) - plain).abs() <= 5 * standard_error + 1e-12).all())
