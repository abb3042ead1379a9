"""L0 (CPU): the dropout forward kind renders and compiles for every arch of the sm80 family, with
the Philox code only where dropout is on; forward_dropout's argument errors. The mask's mapping
and the reference are tests/test_philox.py's; the GPU suite is test_gpu_dropout.py."""

from __future__ import annotations

import pytest
import torch

from fa_gen.dropout import forward_dropout
from fa_gen.errors import InputError
from fa_gen.render import render_target
from fa_gen.runtime import resolve_spec
from fa_gen.target import resolve_target


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_dropout_kind_compiles(tmp_path, monkeypatch, arch):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    for name in ("causal_bf16_d128", "chunked_causal"):
        target = resolve_target(resolve_spec(name), arch, "forward_dropout")
        assert target.family.name == "sm80"
        text = render_target(target).text
        assert "def philox4x32(" in text and "dropout_probabilities(acc_S_mn" in text
        path = tmp_path / f"{name}.o"
        compile_to_object(text, arch, path, label=name)
        assert path.stat().st_size > 0


def test_no_philox_without_dropout():
    text = render_target(resolve_target(resolve_spec("causal_bf16_d128"), "sm_80", "forward")).text
    assert "philox" not in text.lower()


@pytest.mark.parametrize("p,seed,offset,message", [
    (0.0, 1, 0, "dropout_p"), (1.0, 1, 0, "dropout_p"), (-0.1, 1, 0, "dropout_p"), ("0.1", 1, 0, "dropout_p"),
    (0.1, -1, 0, "seed"), (0.1, 1 << 64, 0, "seed"), (0.1, 1, -5, "offset"),
])
def test_argument_errors(p, seed, offset, message):
    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=message):
        forward_dropout(resolve_spec("causal_bf16_d128"), q, q, q, p, seed, offset)
