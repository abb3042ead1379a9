"""L0 (CPU): MLA decode's spec pair, family, kinds (rendered and compiled for sm_90a), argument
errors and its per-sequence reference. The GPU suite is test_gpu_mla.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fa_gen
from fa_gen.errors import InputError, SpecError, UnsupportedError
from fa_gen.mla import mla_decode, mla_reference, splits_for
from fa_gen.reference import attention_reference
from fa_gen.render import render_target
from fa_gen.schema import json_schema
from fa_gen.spec import MaskKind
from fa_gen.spec_load import load_spec
from fa_gen.target import resolve_target

MLA = {"name": "mla", "dtype": "bf16", "head_dim": {"qk": 576, "v": 512}, "mask": "causal",
       "softmax_scale": 192 ** -0.5}


def test_the_mla_pair_is_a_spec_and_nothing_else_past_256():
    spec = load_spec(MLA)
    assert (spec.head_dim_qk, spec.head_dim_v) == (576, 512) and spec.archs == ("sm_90a",)
    for qk, v in ((576, 256), (512, 512), (576, 576), (264, 264)):
        with pytest.raises(SpecError, match="MLA"):
            load_spec({**MLA, "head_dim": {"qk": qk, "v": v}})
    with pytest.raises(SpecError):
        load_spec({**MLA, "head_dim": 576})


def test_schema_takes_the_mla_pair_alone():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    head_dim = json_schema()["properties"]["head_dim"]
    validator.validate(MLA)
    assert not jsonschema.Draft202012Validator({**head_dim, "$defs": json_schema()["$defs"]}).is_valid(
        {"qk": 576, "v": 256})


def test_family_serves_the_decode_kinds_only():
    spec = load_spec(MLA)
    for kind in ("mla_decode", "mla_decode_paged"):
        assert resolve_target(spec, "sm_90a", kind).family.name == "sm90_mla"
    with pytest.raises(UnsupportedError, match="renders no forward kernel: an MLA spec"):
        resolve_target(spec, "sm_90a", "forward")
    with pytest.raises(UnsupportedError, match="MLA decode"):
        fa_gen.build(spec, "sm_90a")
    # Not for another head dim, nor another mask.
    with pytest.raises(UnsupportedError, match="sm90_mla: head_dim"):
        resolve_target(fa_gen.runtime.resolve_spec("causal_bf16_d128"), "sm_90a", "mla_decode")
    window = dataclasses.replace(load_spec(MLA), mask=MaskKind.SLIDING_WINDOW, window_left=64)
    with pytest.raises(UnsupportedError, match="none or causal"):
        resolve_target(window, "sm_90a", "mla_decode")


@pytest.mark.parametrize("kind", ["mla_decode", "mla_decode_paged"])
@pytest.mark.parametrize("spec_fields", [MLA, {**MLA, "dtype": "fp16", "mask": "none"}])
def test_kinds_render_and_compile(tmp_path, monkeypatch, kind, spec_fields):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    spec = load_spec(spec_fields)
    text = render_target(resolve_target(spec, "sm_90a", kind)).text
    assert ("mPageTable" in text) == (kind == "mla_decode_paged")
    assert ("CAUSAL = True" in text) == (spec.mask.value == "causal")
    path = tmp_path / "k.o"
    compile_to_object(text, "sm_90a", path, label=kind)
    assert path.stat().st_size > 0


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("change,message", [
    (dict(q=_meta(2, 1, 16, 512)), "q must be 4-D"),
    (dict(q=_meta(2, 1, 16, 576, dtype=torch.float16)), "dtype"),
    (dict(kv=_meta(2, 100, 2, 576)), "one latent KV head"),
    (dict(kv=_meta(3, 100, 1, 576)), "batch 3"),
    (dict(seqlens=torch.zeros(2, dtype=torch.int64, device="meta")), "int32"),
    (dict(seqlens=101), "outside 0..100"),
    (dict(table=torch.zeros(2, 4, dtype=torch.int32, device="meta"), kv=_meta(9, 48, 1, 576)), "multiple of 64"),
    (dict(table=torch.zeros(3, 4, dtype=torch.int32, device="meta"), kv=_meta(9, 64, 1, 576)), "3 rows"),
    (dict(q=torch.empty(2, 1, 16, 576, dtype=torch.bfloat16), seqlens=5), "CUDA"),
])
def test_argument_errors(change, message):
    args = dict(q=_meta(2, 1, 16, 576), kv=_meta(2, 100, 1, 576), seqlens=torch.zeros(2, dtype=torch.int32,
                                                                                     device="meta"), table=None)
    args.update(change)
    with pytest.raises(InputError, match=message):
        mla_decode(args["q"], args["kv"], args["seqlens"], load_spec(MLA), block_table=args["table"], arch="sm_90a")


def test_a_spec_of_other_head_dims_is_refused():
    with pytest.raises(UnsupportedError, match="576"):
        mla_decode(_meta(1, 1, 16, 128), _meta(1, 10, 1, 128), 5, "causal_bf16_d128", arch="sm_90a")


def test_reference_is_each_sequence_alone_and_pages_map_keys():
    """mla_reference over a paged cache (shuffled pages) equals attention_reference over the
    sequence's own keys, V being the keys' first 512 columns."""
    spec = load_spec(MLA)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 576, generator=g, dtype=torch.float64)
    keys = [torch.randn(n, 1, 576, generator=g, dtype=torch.float64) for n in (130, 7)]
    pool = torch.full((6, 64, 1, 576), math.nan, dtype=torch.float64)
    table = torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32)
    for b, k in enumerate(keys):
        for p in range(-(-k.shape[0] // 64)):
            rows = k[p * 64:(p + 1) * 64]
            pool[table[b, p], :rows.shape[0]] = rows
    for b, (out, lse) in enumerate(mla_reference(q, pool, [130, 7], spec, table)):
        k = keys[b].unsqueeze(0)
        want, want_lse = attention_reference(q[b:b + 1], k, k[..., :512], spec)
        torch.testing.assert_close(out, want[0], rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse[0], rtol=0, atol=0)
        assert torch.isfinite(out).all()
    # Sequence 1 (7 keys) has seqlen_q 3: causal rows see up to 7 - 3 + s keys.
    assert torch.isfinite(mla_reference(q, pool, [130, 2], spec, table)[1][1][:, 0]).logical_not().all()


def test_splits_fill_the_gpu_from_shapes(monkeypatch):
    monkeypatch.setattr(fa_gen.mla, "_num_sms", lambda index: 132)
    device = torch.device("cuda", 0)
    assert splits_for(128, 16, 8192, device) == 1           # 128 tiles: 0.97 of a wave
    assert splits_for(64, 16, 8192, device) == 2            # 64 tiles: two splits fill 128 SMs
    assert splits_for(1, 128, 65536, device) > 32            # 2 tiles: split the keys
    assert splits_for(264, 128, 8192, device) == 1           # 528 tiles: whole waves already
    assert splits_for(1, 16, 64, device) == 1                # one key tile cannot split


def test_flash_mla_signature_maps_onto_mla_decode(monkeypatch):
    """FlashMLA's flash_mla_with_kvcache: the spec from (dtype, causal, softmax_scale), the cache
    and table passed through, the metadata not needed; wrong head dims are refused."""
    import fa_gen.api.flash_mla as flash_mla

    seen = {}
    monkeypatch.setattr(flash_mla, "mla_decode", lambda q, k, seqlens, spec, block_table=None: seen.update(
        q=q, k=k, seqlens=seqlens, spec=spec, table=block_table) or ("out", "lse"))
    q, k = _meta(2, 2, 16, 576), _meta(9, 64, 1, 576)
    table, seqlens = torch.zeros(2, 4, dtype=torch.int32, device="meta"), torch.zeros(2, dtype=torch.int32, device="meta")
    metadata, splits = fa_gen.api.get_mla_metadata(seqlens, 2 * 16, 1)
    assert fa_gen.api.flash_mla_with_kvcache(q, k, table, seqlens, 512, metadata, splits, causal=True,
                                             softmax_scale=0.1) == ("out", "lse")
    assert seen["q"] is q and seen["k"] is k and seen["table"] is table and seen["seqlens"] is seqlens
    spec = seen["spec"]
    assert (spec.head_dim_qk, spec.head_dim_v, spec.mask.value, spec.softmax_scale, spec.dtype.value) == \
        (576, 512, "causal", 0.1, "bf16")
    fa_gen.api.flash_mla_with_kvcache(_meta(2, 2, 16, 576, dtype=torch.float16), k, None,
                                      seqlens, 512)
    assert (seen["spec"].mask.value, seen["spec"].softmax_scale, seen["spec"].dtype.value) == \
        ("none", 576 ** -0.5, "fp16")
    with pytest.raises(UnsupportedError, match="qk 576"):
        fa_gen.api.flash_mla_with_kvcache(q, k, table, seqlens, 256)
    with pytest.raises(UnsupportedError, match="one latent KV head"):
        fa_gen.api.get_mla_metadata(seqlens, 16, 2)
    with pytest.raises(InputError, match="softmax_scale"):
        fa_gen.api.flash_mla_with_kvcache(q, k, table, seqlens, 512, softmax_scale=-1.0)


def test_attention_with_kvcache_routes_mla_specs(monkeypatch):
    """fa_gen.attention_with_kvcache with an MLA spec: mla_decode over the cache, after the
    append (lengths + new tokens); v_cache / v_new must be views of the latent cache / k_new."""
    import fa_gen.api.kvcache as kvcache

    seen = {}
    monkeypatch.setattr(kvcache, "mla_decode", lambda q, k, lengths, spec, block_table=None, num_splits=None:
                        seen.update(q=q, k=k, lengths=lengths, table=block_table) or
                        (q.new_empty(*q.shape[:3], 512), torch.empty(q.shape[0], q.shape[2], q.shape[1])))
    monkeypatch.setattr(kvcache, "_check_devices", lambda **tensors: None)
    monkeypatch.setattr(kvcache, "append_to_cache", lambda *args: seen.update(appended=args))
    spec = load_spec({**MLA, "mask": "none"})
    q, cache = _meta(2, 1, 16, 576), _meta(2, 128, 1, 576)
    lengths = torch.zeros(2, dtype=torch.int32, device="meta")
    new = _meta(2, 1, 1, 576)
    out, lse = fa_gen.attention_with_kvcache(q, cache, cache[..., :512], lengths, spec, k_new=new, v_new=new[..., :512])
    assert seen["k"] is cache and seen["q"] is q and seen["table"] is None and "appended" in seen
    assert out.shape == (2, 1, 16, 512)
    with pytest.raises(UnsupportedError, match=r"v_cache = k_cache\[..., :512\]"):
        fa_gen.attention_with_kvcache(q, cache, _meta(2, 128, 1, 512), lengths, spec)
    with pytest.raises(UnsupportedError, match=r"v_new = k_new\[..., :512\]"):
        fa_gen.attention_with_kvcache(q, cache, cache[..., :512], lengths, spec, k_new=new, v_new=_meta(2, 1, 1, 512))


def test_flash_attn_with_kvcache_of_mla_shapes_reaches_mla_decode(monkeypatch):
    """FlashAttention's flash_attn_with_kvcache with q/k 576 and v_cache = k_cache[..., :512]
    builds an MLA spec (causal, the scale given) and runs MLA decode on the paged cache."""
    import fa_gen.api.kvcache as kvcache

    seen = {}
    monkeypatch.setattr(kvcache, "mla_decode", lambda q, k, lengths, spec, block_table=None, num_splits=None:
                        seen.update(spec=spec, table=block_table) or
                        (q.new_empty(*q.shape[:3], 512), torch.empty(q.shape[0], q.shape[2], q.shape[1])))
    monkeypatch.setattr(kvcache, "_check_devices", lambda **tensors: None)
    q, cache = _meta(2, 1, 16, 576), _meta(9, 64, 1, 576)
    table = torch.zeros(2, 4, dtype=torch.int32, device="meta")
    out = fa_gen.flash_attn_with_kvcache(q, cache, cache[..., :512], cache_seqlens=torch.zeros(
        2, dtype=torch.int32, device="meta"), block_table=table, causal=True, softmax_scale=192 ** -0.5)
    spec = seen["spec"]
    assert out.shape == (2, 1, 16, 512) and seen["table"] is table
    assert (spec.head_dim_qk, spec.head_dim_v, spec.mask.value, spec.softmax_scale) == (576, 512, "causal", 192 ** -0.5)
