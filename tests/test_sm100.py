"""L0 (CPU): the sm100 family (tcgen05, tensor memory), checked without a Blackwell GPU (issue 20).

The family is opt-in (family="sm100") until a Blackwell GPU has run it; the Ampere-class sm80
family stays the default on sm_100a/sm_103a. Every shipped spec it claims compiles here for
every arch it names, and the SASS holds its structure: tcgen05 MMAs (UTCHMMA), TMA loads
(UTMALDG), tensor-memory loads and stores (LDTM/STTM), one TMEM allocation paired with one
release, and no local memory (a register spill is STL/LDL). The exactness suite that runs the
day a Blackwell GPU is present is tests/test_gpu_sm100.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fa_gen import archs, sass
from fa_gen.arch_table import arch_info
from fa_gen.errors import UnsupportedError
from fa_gen.families.sm100 import TMEM_COLUMNS, Sm100Family, tile_config
from fa_gen.render import render_target
from fa_gen.runtime import resolve_spec
from fa_gen.spec_load import load_spec
from fa_gen.target import resolve_target

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
SHIPPED = sorted(p.stem for p in SPECS_DIR.glob("*.yaml"))
FAMILY = Sm100Family()
# What the family serves today: fp16/bf16, head dims 64/96/128, windows and every expression.
CLAIMED = ["alibi", "alibi_supplied", "attention_sinks", "causal_bf16_d128", "causal_fp16_d64",
           "causal_topleft_fp16_d96", "chunked_causal", "document", "full_bf16_d128", "full_fp16_d64", "prefix_lm",
           "relative_bias", "sink_logit", "sliding_window_bf16_d128", "sliding_window_causal", "softcap"]


def claimed(name: str) -> bool:
    return not FAMILY.can_implement(resolve_spec(name), "sm_100a")


def test_the_family_claims_these_shipped_specs_and_says_why_not_the_others():
    assert [name for name in SHIPPED if claimed(name)] == CLAIMED
    reasons = {name: FAMILY.can_implement(resolve_spec(name), "sm_100a") for name in SHIPPED if not claimed(name)}
    assert set(reasons) == {"causal_bf16_qk192_v128", "fp8_e4m3_d128", "full_bf16_d256"}
    assert "head_dim" in " ".join(reasons["full_bf16_d256"])
    assert "head_dim (qk 192, v 128)" in " ".join(reasons["causal_bf16_qk192_v128"])
    assert "dtype fp8_e4m3" in " ".join(reasons["fp8_e4m3_d128"])


def test_it_is_opt_in_and_renders_the_forward_only():
    spec = resolve_spec("causal_bf16_d128")
    for arch in ("sm_100a", "sm_103a"):
        assert archs.family_for(spec, arch).name == "sm80"
        assert resolve_target(spec, arch, "forward").family.name == "sm80"
        assert resolve_target(spec, arch, "forward", family="sm100").family.name == "sm100"
    with pytest.raises(UnsupportedError, match="fixed-length forward only"):
        resolve_target(spec, "sm_100a", "backward", family="sm100")
    with pytest.raises(UnsupportedError, match="serves sm_100a"):
        resolve_target(spec, "sm_90a", "forward", family="sm100")


@pytest.mark.parametrize("name", CLAIMED)
def test_budgets_fit_tensor_and_shared_memory(name):
    """Two S buffers and O within TMEM's 512 columns; Q, the K/V ring and two P buffers within
    the arch's shared memory (the kernel's struct adds its mbarriers and row statistics, which
    the family's overhead term covers)."""
    spec = resolve_spec(name)
    cfg = tile_config(spec)
    assert cfg.tmem_columns(spec.head_dim_qk) <= TMEM_COLUMNS
    assert cfg.smem_bytes(spec.head_dim_qk) <= arch_info("sm_100a").max_smem_per_block


def test_tuning_that_breaks_a_budget_is_refused_with_the_reason():
    from fa_gen.errors import SpecError

    base = {"name": "t", "dtype": "bf16", "head_dim": 128, "mask": "causal"}
    with pytest.raises(SpecError, match="shared memory"):
        load_spec({**base, "tuning": {"sm100": {"num_stages": 4}}})
    with pytest.raises(SpecError, match="multiple of 32"):
        load_spec({**base, "tuning": {"sm100": {"tile_n": 80}}})
    # Within budget: taken as given.
    assert tile_config(load_spec({**base, "tuning": {"sm100": {"tile_n": 64, "num_stages": 4}}})).num_stages == 4


def _sass_counts(name: str, arch: str, tmp_path, monkeypatch):
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    target = resolve_target(resolve_spec(name), arch, "forward", family="sm100")
    path = tmp_path / f"{name}-{arch}.o"
    compile_to_object(render_target(target).text, arch, path, label=f"{name} sm100 {arch}")
    if sass.nvdisasm_path() is None:
        pytest.skip("the SASS check needs the test extras' nvidia-cuda-nvdisasm")
    return sass.opcode_counts(sass.disassemble(path))


def _check_structure(counts, what: str):
    for opcode in ("UTCHMMA", "UTMALDG", "LDTM", "STTM", "UTCBAR"):
        assert sass.has(counts, opcode), f"{what}: no {opcode} in its SASS"
    # One allocation (FIND_AND_SET, in a retry loop: it may appear twice) and one release.
    assert sass.has(counts, "UTCATOMSWS.FIND_AND_SET") >= 1, f"{what}: no TMEM allocation"
    assert sass.has(counts, "UTCATOMSWS.AND") == 1, f"{what}: TMEM released {sass.has(counts, 'UTCATOMSWS.AND')} times"
    for opcode in ("STL", "LDL"):
        assert not sass.has(counts, opcode), f"{what}: {sass.has(counts, opcode)} {opcode} (local memory)"


@pytest.mark.parametrize("name", CLAIMED)
def test_every_claimed_spec_compiles_for_sm_100a_with_its_structure(name, tmp_path, monkeypatch):
    _check_structure(_sass_counts(name, "sm_100a", tmp_path, monkeypatch), f"{name} on sm_100a")


@pytest.mark.parametrize("arch", ["sm_103a", "sm_100f", "sm_103f"])
@pytest.mark.parametrize("name", ["causal_bf16_d128", "document"])
def test_the_other_archs_compile_too(name, arch, tmp_path, monkeypatch):
    _check_structure(_sass_counts(name, arch, tmp_path, monkeypatch), f"{name} on {arch}")


def _render_module(spec, monkeypatch):
    from fa_gen.backends.cute_dsl import _import_rendered

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    text = render_target(resolve_target(spec, "sm_100a", "forward", family="sm100")).text
    return _import_rendered(text, f"fa_gen_sm100_test_{abs(hash(text)) & 0xFFFFFFFF:08x}")


@pytest.mark.parametrize("name", ["causal_bf16_d128", "softcap", "causal_topleft_fp16_d96", "full_fp16_d64"])
def test_register_grants_fit_the_launch(name, monkeypatch):
    """setmaxnreg.inc waits for registers the other warpgroups gave back: the three grants may not
    exceed three warpgroups at the launch count (65536 registers over the CTA's threads)."""
    module = _render_module(resolve_spec(name), monkeypatch)
    launch = 65536 // module.NUM_THREADS // 8 * 8
    assert module.LAUNCH_REGISTERS == launch
    grants = module.LOAD_MMA_REGISTERS + module.SOFTMAX_REGISTERS + module.CORRECTION_REGISTERS
    assert grants <= 3 * launch, f"{grants} registers granted, {3 * launch} at launch"


def _flat(t) -> list:
    return [x for item in t for x in _flat(item)] if isinstance(t, tuple) else [t]


def _offset(shape, stride, index: int) -> int:
    """A layout's value at a 1-D (column-major) index, from its shape and stride."""
    total = 0
    for extent, step in zip(_flat(shape), _flat(stride)):
        total += index % extent * step
        index //= extent
    return total


@pytest.mark.parametrize("tile_n", [32, 64, 96, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_softmax_writes_p_where_the_mma_reads_it(tile_n, dtype, monkeypatch):
    """Every (row, key, stage) of P: the softmax's row view (p_row_layout) and the P V MMA's
    A-operand layout (make_smem_layout_a) give the same element offset and the same swizzle."""
    import cutlass.cute as cute

    spec = load_spec({"name": "p", "dtype": dtype, "head_dim": 128, "tuning": {"sm100": {"tile_n": tile_n}}})
    module = _render_module(spec, monkeypatch)
    found = {}

    @cute.jit
    def layouts():
        _, pv = module.make_tiled_mmas()
        mma = module.sm100_utils.make_smem_layout_a(pv, module.MMA_TILER_PV, module.DTYPE, module.P_STAGES)
        rows = module.p_row_layout()
        coords = pv.get_slice(0).partition_A(cute.make_identity_tensor((module.TILE_M, module.TILE_N)))
        found.update(mma=(mma.outer.shape, mma.outer.stride, str(mma.inner)),
                     rows=(rows.outer.shape, rows.outer.stride, str(rows.inner)),
                     coords=(coords.layout.shape, [str(s) for s in _flat(coords.layout.stride)]))

    cute.compile(layouts, options="--gpu-arch sm_100a")  # the DSL's own arch may be another test's
    (mma_shape, mma_stride, mma_swizzle), (row_shape, row_stride, row_swizzle) = found["mma"], found["rows"]
    assert mma_swizzle == row_swizzle
    # The coordinate layout's strides are basis elements: "k@0" moves the row by k, "k@1" the key.
    steps = [(0, 0) if s == "0" else ((int(s.split("@")[0]), 0) if s.endswith("@0") else (0, int(s.split("@")[0])))
             for s in found["coords"][1]]
    extents = _flat(found["coords"][0])
    per_stage = module.TILE_M * module.TILE_N
    stage_stride = _flat(mma_stride[3])[0]
    seen = set()
    for stage in range(module.P_STAGES):
        for index in range(per_stage):
            row = key = 0
            rest = index
            for extent, (d_row, d_key) in zip(extents, steps):
                row, key, rest = row + rest % extent * d_row, key + rest % extent * d_key, rest // extent
            seen.add((row, key))
            mma_offset = _offset(mma_shape[:3], mma_stride[:3], index) + stage * stage_stride
            row_offset = _offset(row_shape, row_stride, row + module.TILE_M * (key + module.TILE_N * stage))
            assert mma_offset == row_offset, f"P[{row}, {key}] stage {stage}: MMA reads {mma_offset}, softmax writes {row_offset}"
    assert len(seen) == per_stage


def test_fa_gen_build_reaches_the_family_by_name(tmp_path, monkeypatch, capsys):
    """`fa-gen build SPEC --arch sm_100a --family sm100` compiles the opt-in family on the CPU;
    a family that does not serve the arch is refused with its reason."""
    from fa_gen.cli import main

    monkeypatch.setenv("FA_GEN_CACHE_DIR", str(tmp_path))
    assert main(["build", "causal_fp16_d64", "--arch", "sm_100a", "--family", "sm100"]) == 0
    assert "sm_100a: family sm100, compiled" in capsys.readouterr().out
    assert main(["build", "causal_fp16_d64", "--arch", "sm_90a", "--family", "sm100"]) != 0
    assert "serves sm_100a" in capsys.readouterr().err
