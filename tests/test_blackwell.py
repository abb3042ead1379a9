"""L0 (CPU): Blackwell is served from day one by the Ampere-class family (issue 20, item 1).

Every `a` and `f` target of the Blackwell capabilities the CuTe DSL compiles for (10.0, 10.3,
11.0, 12.0, 12.1) is a known arch; a device of each capability maps to its `a` target; a shipped
spec's forward and backward compile for each here, without a GPU (mma.sync, ldmatrix and
cp.async run there as on the Ampere-class GPUs whose L1 the H100/H200 runs), and their SASS
holds those instructions and no register spills. No Blackwell GPU has run these kernels:
`fa-gen list` and the README say so.
"""

from __future__ import annotations


import pytest

from fa_gen import archs, sass
from fa_gen.arch_table import ARCHS, BLACKWELL_ARCHS, arch_for_capability, named_by
from fa_gen.render import render_target
from fa_gen.runtime import resolve_spec
from fa_gen.target import resolve_target

CAPABILITIES = {(10, 0): "sm_100", (10, 3): "sm_103", (11, 0): "sm_110", (12, 0): "sm_120", (12, 1): "sm_121"}


def test_every_blackwell_target_the_dsl_knows_is_an_arch():
    """The DSL's Blackwell targets with an `a` or `f` suffix, sm_107 aside (the DSL files it under
    Rubin too; no such part is published) and sm_101 (the DSL's old name of sm_110)."""
    base_dsl = pytest.importorskip("cutlass.base_dsl.enums")
    dsl = {arch.name for arch in base_dsl.Arch.BlackwellArchs() if arch.suffix in ("a", "f")}
    dsl -= {name for name in dsl if name.startswith(("sm_107", "sm_101"))}
    assert dsl == set(BLACKWELL_ARCHS)


@pytest.mark.parametrize("capability,base", CAPABILITIES.items())
def test_a_device_maps_to_its_arch_specific_target(capability, base):
    assert arch_for_capability(*capability) == f"{base}a"
    assert ARCHS[f"{base}f"].portable and not ARCHS[f"{base}a"].portable


def test_default_archs_take_the_specific_targets_and_builds_accept_the_portable_ones():
    spec = resolve_spec("causal_bf16_d128")
    assert {f"{b}a" for b in CAPABILITIES.values()} <= set(spec.archs)
    assert not any(ARCHS[a].portable for a in spec.archs)
    # A spec for sm_100a builds for sm_100f (its binary runs on 10.0 and 10.3); not the reverse.
    assert named_by("sm_100f", spec.archs) and not named_by("sm_100f", ("sm_80",))
    for arch in BLACKWELL_ARCHS:
        assert archs.family_for(spec, arch).name == "sm80"


@pytest.mark.parametrize("arch", BLACKWELL_ARCHS)
def test_a_shipped_spec_compiles_for_every_blackwell_arch(arch, tmp_path, monkeypatch):
    """The forward and backward of causal_fp16_d64 (and of causal_bf16_d128 on the `a` targets),
    rendered for `arch`, compiled for it, and read back as SASS: the Ampere-class instructions
    (mma.sync as HMMA, ldmatrix as LDSM, cp.async as LDGSTS) and no local-memory traffic (a
    register spill is STL/LDL; the forward's tiles once spilled 200+ bytes on sm_100a)."""
    from fa_gen.backends.cute_dsl import compile_to_object

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    names = ("causal_fp16_d64",) + (() if ARCHS[arch].portable else ("causal_bf16_d128",))
    for name in names:
        spec = resolve_spec(name)
        for kind in ("forward", "backward"):
            target = resolve_target(spec, arch, kind)
            assert target.family.name == "sm80"
            path = tmp_path / f"{name}-{kind}.o"
            compile_to_object(render_target(target).text, arch, path, label=f"{arch} {kind}")
            if sass.nvdisasm_path() is None:
                continue   # the structure check needs the test extras' nvidia-cuda-nvdisasm
            counts = sass.opcode_counts(sass.disassemble(path))
            what = f"{name} {kind} on {arch}"
            for opcode in ("HMMA", "LDSM", "LDGSTS"):
                assert sass.has(counts, opcode), f"{what}: no {opcode} in its SASS"
            for opcode in ("STL", "LDL"):
                assert not sass.has(counts, opcode), f"{what}: {sass.has(counts, opcode)} {opcode} (local memory)"


def test_sass_reading_finds_the_embedded_device_code():
    """embedded_cubins cuts a CUDA ELF out of a host object by its own headers; junk around it
    and a host ELF (another e_machine) are skipped."""
    import struct

    header = bytearray(64)
    header[0:4], header[4] = b"\x7fELF", 2
    struct.pack_into("<H", header, 18, sass.EM_CUDA)
    struct.pack_into("<QQ", header, 0x20, 64, 128)          # program headers at 64, sections at 128
    struct.pack_into("<HHHH", header, 0x36, 56, 1, 64, 2)    # one 56-byte program header, two sections
    cuda = bytes(header) + bytes(128 + 2 * 64 - 64)
    host = bytearray(header)
    struct.pack_into("<H", host, 18, 62)                     # x86-64
    blob = bytes(host) + b"junk" + cuda + b"tail"
    assert sass.embedded_cubins(blob) == [cuda]
    counts = sass.opcode_counts("        /*0070*/                   @!P0 HMMA.16816.F32 R4, R8, R12, R4 ;\n"
                                "        /*0080*/                   STL.64 [R1], R2 ;\n")
    assert sass.has(counts, "HMMA") == 1 and sass.has(counts, "STL") == 1 and not sass.has(counts, "LDL")
