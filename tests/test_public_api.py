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
