"""Per-call forward variants: which specs get a short-sequence kernel, what it renders, and
which kernel a call's seqlens pick (no GPU: the functions are stand-ins that record calls)."""

import pytest
import torch

from fa_gen.errors import InputError
from fa_gen.families.sm90 import SHORT_KIND
from fa_gen.render import render
from fa_gen.runtime import BuildInfo, Kernel
from fa_gen.spec_load import load_spec


def _spec(head_dim=64, mask="causal", **extra):
    return load_spec({"name": f"t_d{head_dim}", "dtype": "bf16", "head_dim": head_dim, "mask": mask, **extra})


def _kernel(spec, family="sm90"):
    info = BuildInfo(arch="sm_90a", family=family, entry_dir=None, source_filename="forward.py",
                     seconds=0.0, compiled=False)
    return Kernel(spec, "sm_90a", function=lambda *args: None, info=info)


@pytest.mark.parametrize("spec,has_short", [
    (_spec(64), True),
    (_spec(256), True),
    (_spec(64, {"kind": "causal", "alignment": "top_left"}), True),
    (_spec(128), False),                    # no measured short-sequence winner at d128
    (_spec(64, "none"), False),             # the long tile wins without a mask
    (_spec(64, {"kind": "sliding_window", "left": 100, "right": 7}), False),
    (_spec(64, tuning={"sm90": {"tile_n": 96}}), False),   # the spec pinned its tiles
])
def test_which_specs_get_a_short_kernel(spec, has_short):
    kernel = _kernel(spec)
    assert (kernel.kind_for(512, 512) == SHORT_KIND) == has_short
    assert kernel.kind_for(4096, 4096) == "forward"


def test_the_sm80_family_has_no_variants():
    assert _kernel(_spec(64), family="sm80").kind_for(128, 128) == "forward"


@pytest.mark.parametrize("seqlen_q,seqlen_k,kind", [
    (1, 1, SHORT_KIND), (1024, 1024, SHORT_KIND), (1024, 1025, "forward"), (1025, 3, "forward"),
    (3, 5000, "forward"),
])
def test_the_longer_seqlen_decides(seqlen_q, seqlen_k, kind):
    assert _kernel(_spec(64)).kind_for(seqlen_q, seqlen_k) == kind


@pytest.mark.parametrize("seqlen,kind", [(512, "forward"), (1024, "forward"), (1025, SHORT_KIND),
                                         (2048, SHORT_KIND), (2049, "forward")])
def test_d192_causal_keeps_the_long_kernel_up_to_1k(seqlen, kind):
    assert _kernel(_spec(192)).kind_for(seqlen, seqlen) == kind
    assert _kernel(_spec(192, "none")).kind_for(seqlen, seqlen) == "forward"


def test_the_short_kernel_renders_its_own_tiles():
    spec = _spec(64)
    short = render(spec, "sm_90a", "sm90", SHORT_KIND)
    long = render(spec, "sm_90a", "sm90")
    assert short.filename == "forward_short.py"
    assert "TILE_M = 128" in short.text and "TILE_M = 192" in long.text
    d256 = _spec(256)
    assert "PERSIST_M_BLOCKS = 0" in render(d256, "sm_90a", "sm90", SHORT_KIND).text
    assert "PERSIST_M_BLOCKS = 0" not in render(d256, "sm_90a", "sm90").text


def test_calls_go_to_the_kernel_their_seqlens_pick():
    kernel = _kernel(_spec(64))
    calls = []
    kernel._function = lambda *args: calls.append("forward")
    kernel._variant_functions[SHORT_KIND] = lambda *args: calls.append(SHORT_KIND)
    for seqlen in (100, 3000):
        kernel._function_for(seqlen, seqlen)()
    kernel.pinned("forward")._function_for(100, 100)()
    kernel.pinned(SHORT_KIND)._function_for(3000, 3000)()
    assert calls == [SHORT_KIND, "forward", "forward", SHORT_KIND]


def test_pinning_an_unknown_kind_names_the_kinds():
    with pytest.raises(InputError, match="has no 'backward' kernel.*forward, forward_short"):
        _kernel(_spec(64)).pinned("backward")


def test_cpu_tensors_are_refused_before_any_kernel_is_picked():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="CUDA"):
        _kernel(_spec(64)).forward(q, q, q)
