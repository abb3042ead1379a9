"""L0 (CPU): the dropout forward kind renders and compiles for every arch of the sm80 family, with
the Philox code only where dropout is on; forward_dropout's argument errors. The mask's mapping
and the reference are tests/test_philox.py's; the GPU suite is test_gpu_dropout.py."""

from __future__ import annotations

import pytest
import torch

from fa_gen.dropout import backward_dropout, forward_dropout
from fa_gen.errors import InputError
from fa_gen.render import render_target
from fa_gen.runtime import resolve_spec
from fa_gen.target import resolve_target


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("kind,marker", [("forward_dropout", "dropout_probabilities(acc_S_mn"),
                                         ("backward_dropout", "scale_fragment(acc_S_mn, acc_Z_mn)"),
                                         ("forward_varlen_dropout", "dropout_probabilities(acc_S_mn"),
                                         ("backward_varlen_dropout", "scale_fragment(acc_S_mn, acc_Z_mn)")])
def test_dropout_kinds_compile(tmp_path, monkeypatch, arch, kind, marker):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    # A plain mask; on sm_90a also a mask expression (listed tiles) and a score mod (its derivative).
    for name in ("causal_bf16_d128",) + (("chunked_causal", "softcap") if arch == "sm_90a" else ()):
        spec = resolve_spec(name)
        target = resolve_target(spec, arch, kind)
        # Hopper's own dropout forwards (TMA, wgmma; its varlen one takes no mask expression);
        # the sm80 kernels for the rest.
        hopper = arch == "sm_90a" and kind.startswith("forward") and not (kind == "forward_varlen_dropout"
                                                                            and spec.mask_expr is not None)
        assert target.family.name == ("sm90" if hopper else "sm80")
        text = render_target(target).text
        assert "def philox4x32(" in text and marker in text
        path = tmp_path / f"{name}.o"
        compile_to_object(text, arch, path, label=name)
        assert path.stat().st_size > 0


@pytest.mark.parametrize("kind", ["forward", "backward", "backward_varlen", "forward_split"])
def test_no_philox_without_dropout(kind):
    text = render_target(resolve_target(resolve_spec("causal_bf16_d128"), "sm_80", kind)).text
    assert "philox" not in text.lower()


@pytest.mark.parametrize("p,seed,offset,message", [
    (0.0, 1, 0, "dropout_p"), (1.0, 1, 0, "dropout_p"), (-0.1, 1, 0, "dropout_p"), ("0.1", 1, 0, "dropout_p"),
    (0.1, -1, 0, "seed"), (0.1, 1 << 64, 0, "seed"), (0.1, 1, -5, "offset"),
])
def test_argument_errors(p, seed, offset, message):
    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=message):
        forward_dropout(resolve_spec("causal_bf16_d128"), q, q, q, p, seed, offset)


def test_backward_argument_errors():
    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="dropout_p"):
        backward_dropout(resolve_spec("causal_bf16_d128"), q, q, q, q, q, None, 1.5, 1, 0)
    with pytest.raises(InputError, match="seed"):
        backward_dropout(resolve_spec("causal_bf16_d128"), q, q, q, q, q, None, 0.5, True, 0)



