"""L0: fa_gen.philox reproduces Random123's Philox4x32 known answers and maps dropout indices
as its docstring says (what the dropout kernels will be checked against bit for bit)."""

from __future__ import annotations

import random

import pytest
import torch

from fa_gen.philox import MASK32, _mulhilo, dropout_keep, keep_threshold, philox4x32

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
    # Four neighbouring keys of a row share one Philox call: the mask equals the words' test.
    words = philox4x32(torch.stack([k.expand(64, -1) // 4, q.expand(-1, 256), torch.full((64, 256), 1 * 8 + 3),
                                    torch.full((64, 256), 8)], -1), torch.tensor([1234, 0]))
    expected = torch.gather(words, -1, (k.expand(64, -1) % 4).unsqueeze(-1)).squeeze(-1) < keep_threshold(0.25)
    assert torch.equal(keep, expected)
    # 16384 Bernoulli(0.75) draws: the kept share within 5 standard deviations of 0.75.
    assert abs(keep.double().mean().item() - 0.75) < 5 * (0.75 * 0.25 / keep.numel()) ** 0.5
    # Same state, same mask; another offset, seed or head, another mask.
    again = dropout_keep(1234, 8, 1, 3, 8, q, k, 0.25)
    assert torch.equal(keep, again)
    for other in (dropout_keep(1234, 9, 1, 3, 8, q, k, 0.25), dropout_keep(1235, 8, 1, 3, 8, q, k, 0.25),
                  dropout_keep(1234, 8, 1, 4, 8, q, k, 0.25), dropout_keep(1234, 8 + (1 << 32), 1, 3, 8, q, k, 0.25)):
        assert not torch.equal(keep, other)


def test_threshold():
    assert keep_threshold(0.0) == MASK32
    assert keep_threshold(0.5) == 1 << 31
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError):
            keep_threshold(p)
