"""The top-level functions (lazy wrappers in fa_gen/__init__) against the API layer (fa_gen.api)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["attention", "attention_varlen", "attention_with_kvcache", "mla_decode"])
def test_top_level_functions_pass_every_api_parameter(name, monkeypatch):
    """`fa_gen.attention` & co. (lazy wrappers in fa_gen/__init__) reach the API layer with every
    argument it takes: a wrapper that drops one (dropout_p was dropped once, found on the H100)
    fails here on the CPU."""
    import inspect

    import fa_gen
    import fa_gen.api

    signature = inspect.signature(getattr(fa_gen.api, name))
    sentinels = {n: object() for n, p in signature.parameters.items() if p.kind is not p.VAR_KEYWORD}
    seen = {}
    monkeypatch.setattr(fa_gen.api, name, lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    getattr(fa_gen, name)(**sentinels)
    got = signature.bind(*seen["args"], **seen["kwargs"]).arguments
    for n, sentinel in sentinels.items():
        assert got.get(n) is sentinel, f"fa_gen.{name} does not pass {n} through"


def _cpu_calls():
    import torch

    import fa_gen

    q = torch.randn(1, 5, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 7, 2, 128, dtype=torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    mla = fa_gen.load_spec({"name": "cpu_mla", "dtype": "bf16", "head_dim": {"qk": 576, "v": 512}})
    lengths = torch.tensor([3], dtype=torch.int32)
    return {
        "attention": lambda: fa_gen.attention(q, k, k, "causal_bf16_d128"),
        "attention_varlen": lambda: fa_gen.attention_varlen(q[0], k[0], k[0], cu_q, cu_k, 5, 7, "causal_bf16_d128"),
        "attention_with_kvcache": lambda: fa_gen.attention_with_kvcache(q, k, k, lengths, "causal_bf16_d128"),
        "flash_attn_func": lambda: fa_gen.flash_attn_func(q, k, k, causal=True),
        "flash_attn_varlen_func": lambda: fa_gen.flash_attn_varlen_func(q[0], k[0], k[0], cu_q, cu_k, 5, 7),
        "flash_attn_with_kvcache": lambda: fa_gen.flash_attn_with_kvcache(q, k, k, cache_seqlens=3),
        "merge_attention_states": lambda: fa_gen.merge_attention_states(torch.randn(2, 3, 4, 128),
                                                                        torch.randn(2, 3, 4)),
        "mla_decode": lambda: fa_gen.mla_decode(torch.randn(1, 1, 16, 576, dtype=torch.bfloat16),
                                                torch.randn(1, 64, 1, 576, dtype=torch.bfloat16), 5, mla),
        "attention_backward_op": lambda: torch.ops.fa_gen.attention_backward(
            q, q, k, k, q, torch.zeros(1, 4, 5), "causal_bf16_d128", False, [], []),
    }


@pytest.mark.parametrize("name", sorted(_cpu_calls()))
def test_cpu_tensors_are_a_clear_input_error(name):
    """Every public entry point (and the backward op) refuses CPU tensors with an InputError that
    says why, not the dispatcher's "Could not run ... 'CPU' backend" (issue 24)."""
    from fa_gen.errors import InputError

    with pytest.raises(InputError, match="CUDA"):
        _cpu_calls()[name]()
