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

from . import gradients, greedy


transformers = pytest.importorskip("transformers", minversion="5.0")


def _reference_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, learnable_sink=None, **_):
    """flash_attn_func's stand-in: the float64 reference of the Spec flash_attn_func builds (the
    models here run without attention dropout)."""
    assert dropout_p == 0.0, "the reference stand-in draws no dropout mask"
    shaped = torch.empty(q.shape, dtype=torch.bfloat16, device="meta")  # the spec's dtype is a label here
    key, inputs = flash_attn._spec_and_inputs(shaped, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                              learnable_sink, heads=q.shape[2], batch=q.shape[0])
    return attention_reference(q, k, v, spec_from_key(key), inputs=inputs)[0].to(q.dtype)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
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


_SMALL = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64)
_ALTERNATING = ["sliding_attention", "full_attention"]


def _llama():
    return transformers.LlamaConfig(**_SMALL)


def _gemma2():
    return transformers.Gemma2Config(**_SMALL, sliding_window=5, attn_logit_softcapping=5.0, query_pre_attn_scalar=48)


def _mistral():
    return transformers.MistralConfig(**_SMALL, sliding_window=5)


def _qwen2():
    return transformers.Qwen2Config(**_SMALL, use_sliding_window=True, sliding_window=5, layer_types=_ALTERNATING)


def _qwen3():
    return transformers.Qwen3Config(**_SMALL)


def _gemma3():
    return transformers.Gemma3TextConfig(**_SMALL, sliding_window=5, attn_logit_softcapping=5.0,
                                         query_pre_attn_scalar=48, layer_types=_ALTERNATING)


def _gpt_oss():
    # Every expert routed (2 of 2): routing weights continuous, no top-k choice for rounding to flip.
    return transformers.GptOssConfig(**dict(_SMALL, intermediate_size=256), sliding_window=5, num_local_experts=2,
                                     num_experts_per_tok=2, layer_types=_ALTERNATING)


# Every decoder family of the issue the installed transformers has (5.x has them all): id -> config.
FAMILIES = {"llama_gqa": _llama, "gemma2_softcap_window": _gemma2, "mistral_window": _mistral,
            "qwen2_window": _qwen2, "qwen3_qk_norm": _qwen3, "gemma3_softcap_alternating": _gemma3,
            "gpt_oss_sinks": _gpt_oss}


def _padded_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 320, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0  # left padding, as generate() pads
    mask[1, :1] = 0
    return ids, mask


def _relative_error(a, b, real):
    return float((a - b)[real].abs().max() / b[real].abs().max())


def _ignore_the_mask(monkeypatch):
    """The bug the integration fixes: attention over the padded rows as if every token were real."""
    monkeypatch.setattr(fa_hf, "_padded", lambda q, k, v, mask, s_aux, options:
                        _reference_func(q, k, v, learnable_sink=s_aux, **options))


def _logits(models, ids, mask):
    with torch.no_grad():
        return [m(input_ids=ids, attention_mask=mask).logits for m in models]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unpadded_logits_match_eager(calls, family):
    ours, theirs = _pair(FAMILIES[family]())
    ids = _padded_batch()[0]
    got, want = _logits((ours, theirs), ids, None)
    assert _relative_error(got, want, torch.ones(ids.shape, dtype=torch.bool)) < 1e-5
    assert set(calls) == {"fixed"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_left_padded_logits_match_eager(calls, family):
    ours, theirs = _pair(FAMILIES[family]())
    ids, mask = _padded_batch()
    got, want = _logits((ours, theirs), ids, mask)
    assert _relative_error(got, want, mask.bool()) < 1e-5
    assert set(calls) == {"varlen"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ignoring_the_padding_mask_would_fail(calls, monkeypatch, family):
    """Negative control: the same comparison fails when the mask is dropped (the bug this fixes)."""
    ours, theirs = _pair(FAMILIES[family]())
    ids, mask = _padded_batch()
    _ignore_the_mask(monkeypatch)
    got, want = _logits((ours, theirs), ids, mask)
    assert _relative_error(got, want, mask.bool()) > 1e-2


def test_right_padded_prefill_matches_eager(calls):
    ours, theirs = _pair(_llama())
    ids, mask = _padded_batch()
    mask = mask.flip(-1)
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask).logits for m in (ours, theirs))
    assert _relative_error(got, want, mask.bool()) < 1e-5


STEPS = 32


def _judge_generate(ours, theirs, ids, mask):
    """greedy generate() of fa_gen (the reference swap, float32 model) against eager float32, the
    noise being float32 eager's own error against the same model in float64 (teacher-forced on
    fa_gen's tokens): every step's logits within twice that (plus a float32 rounding floor), rows
    parting only where the two tokens' float64 logits are within it (tests/greedy.py)."""
    exact = copy.deepcopy(theirs).double()
    if hasattr(exact, "set_experts_implementation"):  # MoE (gpt-oss): grouped matmuls take no float64
        exact.set_experts_implementation("eager")
    run = greedy.generation_run(STEPS, mask)
    got, want = ours.generate(ids, **run), theirs.generate(ids, **run)
    forced = greedy.forced_logits(exact, got.sequences, mask, ids.shape[1])
    noise = float((greedy.forced_logits(theirs, got.sequences, mask, ids.shape[1]) - forced).abs().max())
    allowed = 2 * noise + 8 * torch.finfo(torch.float32).eps * float(forced.abs().max())
    error = float((greedy.step_logits(got) - forced).abs().max())
    assert error <= allowed, f"decode-step logit error {error:.3e} > {allowed:.3e}"
    prompt = ids.shape[1]
    return greedy.agreeing_steps(got.sequences[:, prompt:], want.sequences[:, prompt:], forced, allowed)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_from_a_left_padded_batch_matches_eager(calls, family):
    ours, theirs = _pair(FAMILIES[family]())
    ids, mask = _padded_batch()
    agreed = _judge_generate(ours, theirs, ids, mask)
    assert "varlen" in calls  # (sliding layers whose window holds no padding any more take the fixed path)
    assert sum(agreed) >= STEPS * len(agreed) // 2, agreed  # near-ties aside, the rows agree


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_ignoring_the_padding_mask_would_fail(calls, monkeypatch, family):
    ours, theirs = _pair(FAMILIES[family]())
    ids, mask = _padded_batch()
    _ignore_the_mask(monkeypatch)
    with pytest.raises(AssertionError):
        _judge_generate(ours, theirs, ids, mask)


def _training_trio(config):
    """fa_gen (the reference swap) and eager in bf16, eager in float32: one set of random weights."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    models = []
    for impl, dtype in (("fa_gen", torch.bfloat16), ("eager", torch.bfloat16), ("eager", torch.float32)):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
        model.load_state_dict(base.state_dict())
        models.append(model.to(dtype))
    return models


def _training_errors(config):
    ours, yardstick, exact = _training_trio(config)
    ids, mask = _padded_batch()
    reference = gradients.training_gradients(exact, ids, mask)
    return [gradients.relative_errors(gradients.training_gradients(m, ids, mask), reference)
            for m in (ours, yardstick)]


TRAINED = ["llama_gqa", "gemma2_softcap_window", "gpt_oss_sinks"]


@pytest.mark.parametrize("family", TRAINED)
def test_training_step_gradients_per_parameter(calls, family):
    """One training step on a left-padded batch: every parameter's gradient (relative L2 against
    float32 eager) within twice eager-bf16's own error plus a bf16 step (tests/gradients.py)."""
    ours, yardstick = _training_errors(FAMILIES[family]())
    assert not gradients.outliers(ours, yardstick), gradients.outliers(ours, yardstick)
    assert "varlen" in calls


@pytest.mark.parametrize("family", TRAINED)
def test_a_backward_without_dk_fails_the_training_step_test(calls, monkeypatch, family):
    """Negative control: the same judgement with the attention's dK dropped (K's gradient zeroed)."""
    varlen = fa_hf.flash_attn_varlen_func
    monkeypatch.setattr(fa_hf, "flash_attn_varlen_func",
                        lambda q, k, *a, **kw: varlen(q, gradients.DropGradient.apply(k), *a, **kw))
    ours, yardstick = _training_errors(FAMILIES[family]())
    bad = gradients.outliers(ours, yardstick)
    assert any(".k_proj." in name for name in bad), bad


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


def test_dropout_reaches_the_flash_call_and_4d_masks_are_refused(monkeypatch):
    module = torch.nn.Module()
    q = torch.randn(1, 4, 6, 64)
    seen = {}
    monkeypatch.setattr(fa_hf, "flash_attn_func", lambda *a, **options: seen.update(options) or a[0])
    fa_hf.attention_forward(module, q, q, q, None, dropout=0.1)
    assert seen["dropout_p"] == 0.1  # training dropout, as the module hands it over
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
