"""The SASS of a compiled kernel object, for structural checks of kernels no GPU here can run.

    counts = opcode_counts(disassemble("object.o"))      # Counter: "HMMA.16816.F32" -> 768, ...
    has(counts, "HMMA"), has(counts, "STL")               # tensor-core MMAs; local-memory stores

The CuTe DSL's object file is a host ELF that carries the device code as an embedded CUDA ELF
(e_machine 190); `embedded_cubins` cuts it out by its own header, and nvdisasm (the
nvidia-cuda-nvdisasm wheel, a test dependency, or a CUDA toolkit's on PATH) disassembles it.
"""

from __future__ import annotations

import collections
import importlib.util
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from .errors import FaGenError

EM_CUDA = 190
_ELF_MAGIC = b"\x7fELF"
# "        /*0070*/                   @!P0 HMMA.16816.F32 R4, R8, R12, R4 ;" -> HMMA.16816.F32
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def embedded_cubins(object_bytes: bytes) -> list[bytes]:
    """Every 64-bit CUDA ELF inside a host object, each cut at the end of its section or
    program header table (whichever comes last)."""
    cubins, start = [], 1
    while (start := object_bytes.find(_ELF_MAGIC, start)) > 0:
        header = object_bytes[start:start + 64]
        if len(header) == 64 and header[4] == 2 and struct.unpack_from("<H", header, 18)[0] == EM_CUDA:
            phoff, shoff = struct.unpack_from("<QQ", header, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 0x36)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            cubins.append(object_bytes[start:start + end])
            start += end
        else:
            start += len(_ELF_MAGIC)
    return cubins


def nvdisasm_path() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else from PATH; None without either."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("cu*/bin/nvdisasm")) + sorted(Path(root).glob("*/bin/nvdisasm")):
            if candidate.is_file():
                return str(candidate)
    return shutil.which("nvdisasm")


def disassemble(object_path: str | Path) -> str:
    """The SASS of every kernel in a compiled object (nvdisasm's text)."""
    tool = nvdisasm_path()
    if tool is None:
        raise FaGenError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (fa_gen's test extras hold it)")
    cubins = embedded_cubins(Path(object_path).read_bytes())
    if not cubins:
        raise FaGenError(f"{object_path} holds no CUDA ELF")
    texts = []
    with tempfile.TemporaryDirectory(prefix="fa_gen_sass_") as workdir:
        for i, cubin in enumerate(cubins):
            path = Path(workdir) / f"kernel{i}.cubin"
            path.write_bytes(cubin)
            result = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True)
            if result.returncode != 0:
                raise FaGenError(f"nvdisasm failed on {object_path}: {result.stderr.strip()[:300]}")
            texts.append(result.stdout)
    return "\n".join(texts)


def opcode_counts(sass: str) -> collections.Counter:
    """How often each instruction (opcode with its modifiers) appears in nvdisasm text."""
    return collections.Counter(_INSTRUCTION.findall(sass))


def has(counts: collections.Counter, opcode: str) -> int:
    """Instructions whose opcode is `opcode` (any modifiers): has(counts, "STL") counts STL.64 too."""
    return sum(n for name, n in counts.items() if name == opcode or name.startswith(opcode + "."))
