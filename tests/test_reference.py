"""The float64 reference against a naive per-row softmax written independently."""

import math

import pytest
import torch

from fa_gen.reference import attention_reference, visibility
from fa_gen.spec import Alignment, DType, MaskKind, Spec


def make_spec(window_left=None, window_right=None, alignment=Alignment.BOTTOM_RIGHT, dqk=16, dv=16):
    mask = MaskKind.NONE if window_left is None and window_right is None else MaskKind.SLIDING_WINDOW
    return Spec(name="t", dtype=DType.BF16, head_dim_qk=dqk, head_dim_v=dv, mask=mask,
                window_left=window_left, window_right=window_right, alignment=alignment,
                softmax_scale=dqk ** -0.5, archs=("sm_80",))


def naive(q, k, v, spec):
    """Loop over every (batch, head, query row): the definition, with no vectorised masking."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64)
    offset = sk - sq if spec.alignment is Alignment.BOTTOM_RIGHT else 0
    for bi in range(b):
        for h in range(hq):
            kvh = h // (hq // hkv)
            for i in range(sq):
                keys = [j for j in range(sk)
                        if (spec.window_left is None or j >= i + offset - spec.window_left)
                        and (spec.window_right is None or j <= i + offset + spec.window_right)]
                if not keys:
                    continue
                s = torch.stack([q[bi, i, h].double() @ k[bi, j, kvh].double() for j in keys]) * spec.softmax_scale
                m = s.max()
                e = torch.exp(s - m)
                lse[bi, h, i] = m + torch.log(e.sum())
                out[bi, i, h] = sum(e[n] * v[bi, j, kvh].double() for n, j in enumerate(keys)) / e.sum()
    return out, lse


CASES = [
    dict(),                                             # no mask
    dict(window_right=0),                               # causal, bottom-right
    dict(window_right=0, alignment=Alignment.TOP_LEFT),
    dict(window_left=3, window_right=1),                # sliding window
    dict(window_left=0, window_right=0),                # diagonal only
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "none")
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (7, 7), (1, 3)])
def test_reference_matches_naive(case, sq, sk):
    spec = make_spec(**case, dv=8)
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(2, sq, 4, 16, generator=gen)
    k = torch.randn(2, sk, 2, 16, generator=gen)
    v = torch.randn(2, sk, 2, 8, generator=gen)
    out, lse = attention_reference(q, k, v, spec)
    want_out, want_lse = naive(q, k, v, spec)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)
    assert not torch.isnan(out).any()


def test_rows_without_keys_are_zero_and_neg_inf():
    # seqlen_q > seqlen_k with bottom-right causal: the first rows see nothing.
    spec = make_spec(window_right=0)
    q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    out, lse = attention_reference(q, k, v, spec)
    assert visibility(spec, 6, 2).sum(dim=1).tolist() == [0, 0, 0, 0, 1, 2]
    assert (out[:, :4] == 0).all() and torch.isneginf(lse[..., :4]).all()
    assert torch.isfinite(lse[..., 4:]).all()


def test_check_compares_sink_rows_by_their_sink_lse():
    # fa_gen.check on a sink spec: rows that see no key must give O = 0 and LSE = the sink (not
    # -inf); the reference's own outputs pass, an LSE off by a little on such a row fails.
    from fa_gen.check import compare
    from tests.variants import variant_library_paths
    from fa_gen.spec_load import load_spec

    spec = load_spec(variant_library_paths()["sink_logit"], check_archs=False)
    q, k, v = (torch.randn(1, s, 2, 64).to(torch.bfloat16) for s in (9, 3, 3))
    inputs = {"sinks": torch.tensor([0.5, -1.0])}
    out, lse = attention_reference(q, k, v, spec, inputs=inputs)
    assert torch.allclose(lse[0, :, 0].double(), inputs["sinks"].double())  # row 0 sees no key
    result = compare(spec, q, k, v, out.to(torch.bfloat16), lse.float(), inputs=inputs)
    assert result.ok, result
    shifted = lse.float().clone()
    shifted[0, 1, 0] += 0.05  # a row that sees no key: only its sink decides its LSE
    assert not compare(spec, q, k, v, out.to(torch.bfloat16), shifted, inputs=inputs).ok
