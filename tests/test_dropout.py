"""L0 (CPU): the dropout kinds render and compile (sm_80, and Hopper's own where they serve the
spec), with the Philox code only where dropout is on; forward_dropout's argument errors. The mask's mapping
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
    # A plain mask; on sm_90a also a mask expression (listed tiles) and a score mod (its derivative),
    # and d256: the forwards' tile runs without ping-pong there (the fp32 dropout path; P's 16-bit
    # pairs, dropout_pairs, at d128), the backward in the wide layout.
    wide = ("full_bf16_d256",) if arch == "sm_90a" else ()
    # The backward's keys-on-N layout (qk 192): S queries-major, the mask made as the forwards make it.
    wide += ("causal_bf16_qk192_v128",) if arch == "sm_90a" and kind.startswith("backward") else ()
    for name in ("causal_bf16_d128",) + (("chunked_causal", "softcap") if arch == "sm_90a" else ()) + wide:
        spec = resolve_spec(name)
        target = resolve_target(spec, arch, kind)
        # Hopper's own dropout forwards and backwards (TMA, wgmma; its varlen ones take no mask
        # expression; the backward's narrow layout at d128, wide at d256, keys on N at qk 192); the
        # sm80 kernels for the rest.
        hopper = arch == "sm_90a" and (not kind.endswith("varlen_dropout") or spec.mask_expr is None)
        assert target.family.name == ("sm90" if hopper else "sm80")
        text = render_target(target).text
        expected = marker
        if hopper and kind.startswith("backward"):
            # P dropped for dV alone: the wide layout (d256) on its way to shared memory, the narrow
            # one into dV's register operand (after dS, where a score mod's gradient takes P and dS
            # in one pass).
            expected = ("keep_bits_rows_major(ops.tScS" if spec.head_dim_qk == 192
                        else "store_scores(ops, acc_S, ops.tPsP[None, None, None, stage], keep)" if spec.head_dim_qk > 128
                        else "apply_keep_bits(acc_S_qk, keep)" if spec.score_mod_expr
                        else "to_operand_kept(acc_S, ops.tdVrP, keep)")
        if hopper and kind.startswith("forward") and spec.head_dim_qk <= 128:
            expected = "dropout_pairs(cute.recast_tensor(ops.tOrP, cutlass.Uint32)"
        assert "def philox4x32(" in text and expected in text
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





def test_a_device_draw_is_checked_and_passed_as_is():
    from fa_gen.dropout import _check_draw, _draw_arguments

    draw = torch.tensor([5, 8], dtype=torch.int64)
    _check_draw(0.1, draw, None)
    assert _draw_arguments(0.1, draw, None, draw.device)[0] is draw
    for bad, offset in ((torch.tensor([5, 8], dtype=torch.int32), None), (torch.tensor([5, 8, 1]), None), (draw, 3)):
        with pytest.raises(InputError, match="device draw"):
            _check_draw(0.1, bad, offset)


def test_graph_state_snapshots_and_advances(monkeypatch):
    """Under capture each call takes a copy of the device's (seed, offset) and advances the
    state by OFFSET_STEP, so the next call (and the next replay) reads a new offset; without
    a state (no eager call before the capture) the error says what to do."""
    import fa_gen.api.dropout as api_dropout
    from fa_gen import dropout as kernels
    from fa_gen.errors import UnsupportedError

    device = torch.device("cuda", 0)
    monkeypatch.setattr(kernels, "_GRAPH_STATES", {})
    with pytest.raises(UnsupportedError, match="eager step with dropout before capturing"):
        kernels.graph_rng_state(device)
    kernels._GRAPH_STATES[0] = torch.tensor([11, 1 << 40], dtype=torch.int64)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    first, offset = api_dropout.draw(device)
    second, _ = api_dropout.draw(device)
    assert offset is None and first.tolist() == [11, 1 << 40] and second.tolist() == [11, (1 << 40) + kernels.OFFSET_STEP]
    assert kernels._GRAPH_STATES[0].tolist() == [11, (1 << 40) + 2 * kernels.OFFSET_STEP]
