"""L0 (CPU): padded batches to varlen and back (fa_gen.integrations.padding), and the transformers
integration end to end on tiny random models on the CPU, with fa_gen's kernels replaced by the
float64 reference of the very Spec each call builds: what is tested is the mask handling, the
argument mapping and the spec semantics, against transformers' own eager attention. (The GPU
runs the kernels themselves: tests/test_gpu_flash_api.py.) Skipped without transformers >= 5."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from fa_gen.api import flash_attn
from fa_gen.autograd import spec_from_key
from fa_gen.errors import UnsupportedError
import fa_gen.integrations.transformers as fa_hf
from fa_gen.reference import attention_reference


transformers = pytest.importorskip("transformers", minversion="5.0")


def _reference_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, learnable_sink=None, **_):
    """flash_attn_func's stand-in: the float64 reference of the Spec flash_attn_func builds."""
    flash_attn._refuse_dropout(dropout_p)
    shaped = torch.empty(q.shape, dtype=torch.bfloat16, device="meta")  # the spec's dtype is a label here
    key, inputs = flash_attn._spec_and_inputs(shaped, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                              learnable_sink, heads=q.shape[2], batch=q.shape[0])
    return attention_reference(q, k, v, spec_from_key(key), inputs=inputs)[0].to(q.dtype)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, learnable_sink=None, **options):
    if learnable_sink is not None:
        raise UnsupportedError("learnable_sink in flash_attn_varlen_func", ["as the real one"])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(b - a for a, b in zip(ck, ck[1:]))
    outs = [_reference_func(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                            **options)[0] for b in range(len(cq) - 1)]
    return torch.cat(outs)


@pytest.fixture
def calls(monkeypatch):
    made = []

    def record(kind, function):
        return lambda *a, **k: made.append(kind) or function(*a, **k)

    monkeypatch.setattr(fa_hf, "flash_attn_func", record("fixed", _reference_func))
    monkeypatch.setattr(fa_hf, "flash_attn_varlen_func", record("varlen", _reference_varlen))
    fa_hf.register()
    return made


def _pair(config, seed=0):
    """The same random model with attn_implementation fa_gen and eager (float32, CPU)."""
    torch.manual_seed(seed)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="fa_gen")
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval()


def _llama():
    return transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _gemma2():
    return transformers.Gemma2Config(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=5,
                                     attn_logit_softcapping=5.0, query_pre_attn_scalar=48)


def _padded_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 320, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0  # left padding, as generate() pads
    mask[1, :1] = 0
    return ids, mask


def _relative_error(a, b, real):
    return float((a - b)[real].abs().max() / b[real].abs().max())


@pytest.mark.parametrize("config", [_llama, _gemma2], ids=["llama_gqa", "gemma2_softcap_window"])
def test_left_padded_logits_match_eager(calls, config):
    ours, theirs = _pair(config())
    ids, mask = _padded_batch()
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask).logits for m in (ours, theirs))
    assert _relative_error(got, want, mask.bool()) < 1e-5
    assert set(calls) == {"varlen"}


def test_ignoring_the_padding_mask_would_fail(calls, monkeypatch):
    """Negative control: the same comparison fails when the mask is dropped (the bug this fixes)."""
    ours, theirs = _pair(_llama())
    ids, mask = _padded_batch()
    monkeypatch.setattr(fa_hf, "_padded", lambda q, k, v, mask, s_aux, options: _reference_func(q, k, v, **options))
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask).logits for m in (ours, theirs))
    assert _relative_error(got, want, mask.bool()) > 1e-2


def test_right_padded_prefill_matches_eager(calls):
    ours, theirs = _pair(_llama())
    ids, mask = _padded_batch()
    mask = mask.flip(-1)
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask).logits for m in (ours, theirs))
    assert _relative_error(got, want, mask.bool()) < 1e-5


@pytest.mark.parametrize("config", [_llama, _gemma2], ids=["llama_gqa", "gemma2_softcap_window"])
def test_generate_from_a_left_padded_batch_matches_eager(calls, config):
    ours, theirs = _pair(config())
    ids, mask = _padded_batch()
    got, want = (m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False) for m in (ours, theirs))
    assert torch.equal(got, want)
    assert "varlen" in calls


def test_unpadded_decode_takes_the_fixed_length_path(calls):
    ours, theirs = _pair(_llama())
    ids = _padded_batch()[0][:1]
    got, want = (m.generate(ids, max_new_tokens=5, do_sample=False) for m in (ours, theirs))
    assert torch.equal(got, want) and set(calls) == {"fixed"}


def test_packed_position_ids_attend_within_each_sequence(calls):
    ours, theirs = _pair(_llama())
    ids = _padded_batch()[0][:1]
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=positions).logits
        alone = [theirs(input_ids=ids[:, a:b]).logits for a, b in ((0, 5), (5, 8), (8, 12))]
    torch.testing.assert_close(got, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)
    assert "varlen" in calls


def test_cu_seq_lens_kwargs_are_used(calls):
    module = torch.nn.Module()
    q = torch.randn(1, 4, 6, 64)
    k = torch.randn(1, 2, 6, 64)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out, _ = fa_hf.attention_forward(module, q, k, k, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                                     max_length_k=4)
    first = _reference_func(q.transpose(1, 2)[:, :2], k.transpose(1, 2)[:, :2], k.transpose(1, 2)[:, :2], causal=True)
    assert out.shape == (1, 6, 4, 64) and torch.allclose(out[:, :2], first) and calls == ["varlen"]


def test_window_size_follows_transformers():
    assert fa_hf.window_size(None) == (-1, -1)
    assert fa_hf.window_size(4096) == (4095, 4095)


def test_dropout_and_4d_masks_are_refused(calls):
    module = torch.nn.Module()
    q = torch.randn(1, 4, 6, 64)
    with pytest.raises(UnsupportedError, match="dropout_p=0.1"):
        fa_hf.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(UnsupportedError, match="4-D attention_mask"):
        fa_hf.attention_forward(module, q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))


def test_missing_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="needs Hugging Face transformers >= 5.0"):
        fa_hf.register()


def test_old_transformers_is_a_clear_error(monkeypatch):
    # sys.modules, not this module's `transformers`: transformers may swap its module object.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match="found 4.57.1"):
        fa_hf.register()
