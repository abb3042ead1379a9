"""Input validation of a built kernel: every bad call names what is wrong (CPU, no compile)."""

import pytest
import torch

from fa_gen.errors import InputError, UnsupportedError
from fa_gen.runtime import BuildInfo, Kernel, _layout_key, build
from fa_gen.spec_load import load_spec


@pytest.fixture
def kernel():
    spec = load_spec({"name": "t", "dtype": "bf16", "head_dim": 64, "mask": "causal"})
    calls = []
    info = BuildInfo(arch="sm_80", family="sm80", entry_dir=None, source_filename="forward.py",
                     seconds=0.0, compiled=False)
    kern = Kernel(spec, "sm_80", lambda *args: calls.append(args), info)
    kern.calls = calls
    return kern


def qkv(b=2, sq=5, sk=7, hq=4, hkv=2, d=64, dv=64, dtype=torch.bfloat16):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, dv, dtype=dtype))


BAD_INPUTS = [
    (lambda q, k, v: (q.half(), k, v), "q has dtype torch.float16"),
    (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
    (lambda q, k, v: (q, k[..., :32], v), "q and k head_dim must be 64"),
    (lambda q, k, v: (q, k, torch.randn(2, 7, 2, 32, dtype=torch.bfloat16)), "v head_dim must be 64"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch sizes differ"),
    (lambda q, k, v: (q, k, v[:, :3]), "k and v must agree"),
    (lambda q, k, v: (q[:, :, :3], k, v), "heads of q (3) must be a multiple of heads of k/v (2)"),
    (lambda q, k, v: (q.transpose(1, 3).contiguous().transpose(1, 3), k, v), "contiguous last dimension"),
    # A row pitch of 68 elements breaks 16-byte alignment of every other row.
    (lambda q, k, v: (q, torch.randn(2, 7, 2, 68, dtype=torch.bfloat16)[..., :64], v), "strides"),
    (lambda q, k, v: (q, k[:, :0], v[:, :0]), "seqlen_k must be at least 1"),
    (lambda q, k, v: ("q", k, v), "q must be a torch.Tensor"),
    (lambda q, k, v: (q, k, v), "fa_gen kernels need CUDA tensors"),
]


@pytest.mark.parametrize("mutate,message", BAD_INPUTS)
def test_bad_inputs_are_named(kernel, mutate, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kernel(*mutate(*qkv()))
    assert not kernel.calls


def test_arch_outside_the_specs_archs_is_refused():
    spec = load_spec({"name": "t", "dtype": "bf16", "head_dim": 64, "archs": ["sm_80"]})
    with pytest.raises(UnsupportedError, match="add sm_86 to its archs"):
        build(spec, "sm_86")


def test_errors_cross_a_process_pool_whole():
    """A worker of fa_gen.precompile that raises sends its error back pickled: the parent must
    get the same type and message (an UnsupportedError once failed to unpickle, hiding why)."""
    import pickle

    from fa_gen.errors import SpecError

    for error in (UnsupportedError("spec 'x' on sm_90a", ["a reason", "another"]),
                  SpecError("must be a list", path="s.yaml", line=3, field="mask"), InputError("bad q")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
    assert pickle.loads(pickle.dumps(UnsupportedError("w", ["r"]))).reasons == ["r"]


def test_gpu_suites_draw_only_families_with_a_forward():
    """The L1 suites build every forward variant in each family cute_dsl_families names: the MLA
    family renders decode kinds alone and must not be named (it was, and every build failed)."""
    from .variants import cute_dsl_families

    assert cute_dsl_families("sm_90a") == ["sm90", "sm80"]
    assert cute_dsl_families("sm_80") == ["sm80"]


def test_a_broadcast_view_is_named_as_such(kernel):
    """K/V expanded over heads (stride 0) would make the kernels read one row per head: refused
    with what to pass instead (fa_gen.attention copies such views)."""
    q, k, v = qkv(hkv=1)
    with pytest.raises(InputError, match="broadcast view"):
        kernel.forward(q, k.expand(2, 7, 4, 64), v.expand(2, 7, 4, 64))


@pytest.mark.parametrize("mutate,message", BAD_INPUTS[:-1])
def test_a_checked_layout_skips_the_checks_and_no_bad_input_shares_it(kernel, mutate, message):
    """Kernel._check remembers the layouts that passed; a layout it remembers skips the checks
    (here one passed by hand: on a CPU nothing passes), and each bad input above differs from it
    in what the key holds, so it is still checked and refused."""
    good = qkv()
    kernel._checked.add(_layout_key(*good))
    kernel(*good)
    assert len(kernel.calls) == 1
    bad = mutate(*good)
    assert _layout_key(*bad) != _layout_key(*good)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kernel(*bad)
    assert len(kernel.calls) == 1


def test_layout_key_tells_alignment_apart():
    base = torch.randn(2, 7, 2, 72, dtype=torch.bfloat16)
    aligned, shifted = base[..., :64], base[..., 4:68]   # same shape and strides, data 8 bytes apart
    assert _layout_key(aligned) != _layout_key(shifted)
    assert _layout_key("q") is None
