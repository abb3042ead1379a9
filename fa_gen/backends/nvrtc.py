"""NVRTC backend: rendered CUDA C++ -> cubin (NVRTC through cuda-python) -> driver-API launch.

Compiling needs no GPU: NVRTC targets the arch named in `--gpu-architecture`. The headers
come from pip packages: CUTLASS/CuTe from `nvidia-cutlass` (`cutlass_library/source/include`),
CCCL and the runtime headers found by `cuda.pathfinder` (the `nvidia-cuda-cccl` and
`nvidia-cuda-runtime` wheels, else the CUDA toolkit under CUDA_PATH).

Object file: the line `FA_GEN_NVRTC 1`, one line of JSON with the launch configuration
(taken from the source's `// fa_gen-launch: {...}` line), then the cubin. Loading it is a
`cuLibraryLoadData`, so one loaded kernel serves every device of the process.

Kernel ABI: `fa_gen_forward(Params)`, one struct of pointers, strides and sizes declared by
the template (templates/sm75/forward.cu.j2); `_PARAMS` below packs the same fields in the
same order, and `Launcher.__call__` fills it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import json
import re
import struct
import threading
import time
from pathlib import Path

from ..errors import CompileError

MAGIC = b"FA_GEN_NVRTC 1\n"
_LAUNCH_LINE = re.compile(r"^// fa_gen-launch: (\{.*\})$", re.MULTILINE)
_LAUNCH_KEYS = ("kernel", "threads", "tile_m", "smem_bytes")
# -default-device: CUTLASS's headers declare host-and-device helpers without annotations.
# Fast math: exp2f/logf become ex2.approx/lg2.approx, as in the CuTe DSL kernels (fastmath=True).
_BASE_OPTIONS = ("-std=c++17", "-default-device", "--use_fast_math", "-DNDEBUG")
# Params: q, k, v, o, lse pointers; (batch, row, head) strides of q, k, v, o; seqlen_q,
# seqlen_k, heads_q, group_size. Native alignment: 5 x 8 + 12 x 8 + 4 x 4 = 152 bytes.
_PARAMS = struct.Struct("=5Q12q4i")


# --- headers and versions ---------------------------------------------------------------------

def _cutlass_include_dir() -> Path:
    # find_spec, not import: importing cutlass_library pulls in its generator (tens of ms).
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise CompileError("the CUTLASS headers are missing: pip install nvidia-cutlass==4.2.0.0")
    return Path(next(iter(spec.submodule_search_locations))) / "source" / "include"


def _header_dir(libname: str, package: str) -> Path:
    from cuda.pathfinder import locate_nvidia_header_directory

    found = locate_nvidia_header_directory(libname)
    if found is None:
        raise CompileError(f"the {libname} headers are missing: pip install {package} "
                           "(or set CUDA_PATH to a CUDA 13 toolkit)")
    return Path(found.abs_path)


@functools.lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """-I directories: CUTLASS, CCCL and its parent (CUTLASS also includes `<cccl/cuda/std/...>`,
    which a toolkit's CCCL directory alone does not provide), and the runtime headers."""
    cccl = _header_dir("cccl", '"nvidia-cuda-cccl>=13.0,<13.2"')
    dirs = (_cutlass_include_dir(), cccl, cccl.parent, _header_dir("cudart", "nvidia-cuda-runtime"))
    return tuple(dict.fromkeys(str(d) for d in dirs))


def _define_in(header: Path, pattern: str) -> str:
    try:
        match = re.search(pattern, header.read_text(), re.MULTILINE)
    except OSError:
        match = None
    return ".".join(g for g in match.groups()) if match else "unknown"


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """NVRTC and header versions: part of the compile options, hence of every cache key."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    cutlass = _define_in(_cutlass_include_dir() / "cutlass" / "version.h",
                         r"^#define CUTLASS_MAJOR (\d+)\s*\n#define CUTLASS_MINOR (\d+)\s*\n#define CUTLASS_PATCH (\d+)")
    cccl_dir = Path(include_dirs()[1])
    cccl = _define_in(cccl_dir / "cuda" / "std" / "__cccl" / "version.h", r"^#define CCCL_VERSION (\d+)")
    return {"nvrtc": f"{major}.{minor}", "cutlass": cutlass, "cccl": cccl}


def _options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", *_BASE_OPTIONS, *(f"-I{d}" for d in include_dirs())]


def compile_options(arch: str) -> str:
    """Everything besides the source that changes the cubin: part of the cache key.

    Include paths are left out (they differ between machines with the same toolchain);
    the versions of what they hold are in.
    """
    found = " ".join(f"{name} {version}" for name, version in versions().items())
    return f"--gpu-architecture={arch} {' '.join(_BASE_OPTIONS)} ({found})"


# --- compile ------------------------------------------------------------------------------------

def launch_config(source: str) -> dict:
    """The launch configuration the rendered source declares on its `// fa_gen-launch:` line."""
    match = _LAUNCH_LINE.search(source)
    if match is None:
        raise CompileError("rendered source has no '// fa_gen-launch: {...}' line")
    launch = json.loads(match.group(1))
    missing = [key for key in _LAUNCH_KEYS if key not in launch]
    if missing:
        raise CompileError(f"the fa_gen-launch line lacks {', '.join(missing)}")
    return launch


def _nvrtc_check(result, what: str) -> None:
    from cuda.bindings import nvrtc

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC {what}: {result.name}")


def _program_log(nvrtc, program) -> str:
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(program, log)
    return log.rstrip(b"\0 ").decode(errors="replace")


def compile_cubin(source: str, arch: str, label: str = "kernel") -> tuple[bytes, str]:
    """(cubin, NVRTC log) of `source` for `arch`; CompileError with the log on failure."""
    from cuda.bindings import nvrtc

    result, program = nvrtc.nvrtcCreateProgram(source.encode(), f"{label}.cu".encode(), 0, [], [])
    _nvrtc_check(result, "could not create a program")
    try:
        options = [o.encode() for o in _options(arch)]
        (result,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        log = _program_log(nvrtc, program)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed to compile {label} for {arch} ({result.name}):\n{log}")
        result, size = nvrtc.nvrtcGetCUBINSize(program)
        _nvrtc_check(result, "returned no cubin")
        cubin = b" " * size
        (result,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        _nvrtc_check(result, "returned no cubin")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def compile_to_object(source: str, arch: str, object_path: Path, *, label: str = "kernel") -> float:
    """Compile rendered `source` for `arch` into `object_path`; returns seconds spent."""
    start = time.perf_counter()
    launch = launch_config(source)
    cubin, _ = compile_cubin(source, arch, label)
    header = json.dumps(launch, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    Path(object_path).write_bytes(MAGIC + header + cubin)
    return time.perf_counter() - start


def read_object(object_path: Path) -> tuple[dict, bytes]:
    """(launch configuration, cubin) of an object written by `compile_to_object`."""
    data = Path(object_path).read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{object_path} is not an fa_gen NVRTC object")
    header, _, cubin = data[len(MAGIC):].partition(b"\n")
    return json.loads(header), cubin


# --- load and launch ---------------------------------------------------------------------------

def _driver_check(result, what: str) -> None:
    from cuda.bindings import driver

    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver: {what} failed: {result.name}")


@functools.lru_cache(maxsize=1)
def _gpu_visible() -> bool:
    """Whether a CUDA driver with at least one device is there (not on CPU-only CI machines)."""
    try:
        from cuda.bindings import driver

        (result,) = driver.cuInit(0)
        if result != driver.CUresult.CUDA_SUCCESS:
            return False
        result, count = driver.cuDeviceGetCount()
        return result == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # no libcuda: cuda.pathfinder raises its own error types
        return False


def _stream_accessor():
    """device index -> PyTorch's current stream there, as a handle (what
    `torch.cuda.current_stream(index).cuda_stream` returns). The private accessor, also Triton's,
    takes 0.07 us a call on an H200 host; the public one 2.1 us."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda index: torch.cuda.current_stream(index).cuda_stream)


def load_object(object_path: Path) -> "Launcher":
    """Load a compiled object; returns the callable `(q, k, v, out, lse) -> None`.

    With a GPU the cubin is loaded into the driver here, so a bad object fails now (and the
    cache rebuilds it); without one (compile-only machines) loading waits for the first call.
    """
    launch, cubin = read_object(object_path)
    if not cubin.startswith(b"\x7fELF"):
        raise ValueError(f"{object_path} holds no cubin")
    launcher = Launcher(cubin, launch)
    if _gpu_visible():
        launcher.load()
    return launcher


class Launcher:
    """One loaded kernel. Calls pack the tensors' pointers, strides and sizes into the kernel's
    `Params` and launch on PyTorch's current stream of q's device, in the calling thread's
    current CUDA context (so q's device must be the current one, as for PyTorch's own launches)."""

    def __init__(self, cubin: bytes, launch: dict):
        self._cubin = cubin
        self._name = str(launch["kernel"])
        self._threads = int(launch["threads"])
        self._tile_m = int(launch["tile_m"])
        self._smem_bytes = int(launch["smem_bytes"])
        self._driver = None
        self._library = None
        self._kernel = None
        self._ready_devices: set[int] = set()
        self._current_stream = _stream_accessor()
        # The param block and the one-entry pointer array cuLaunchKernel reads it through, built
        # once; the lock keeps two threads from packing into it at once (the driver copies it
        # at launch, so it is free again when cuLaunchKernel returns).
        self._params = ctypes.create_string_buffer(_PARAMS.size)
        self._param_pointers = (ctypes.c_void_p * 1)(ctypes.addressof(self._params))
        self._param_pointers_address = ctypes.addressof(self._param_pointers)
        self._lock = threading.Lock()

    def load(self) -> None:
        """Load the cubin as a library: it enters each device's context on first use there."""
        from cuda.bindings import driver

        (result,) = driver.cuInit(0)
        _driver_check(result, "cuInit")
        result, library = driver.cuLibraryLoadData(self._cubin, None, None, 0, None, None, 0)
        _driver_check(result, "loading the cubin")
        result, kernel = driver.cuLibraryGetKernel(library, self._name.encode())
        _driver_check(result, f"finding kernel {self._name}")
        self._driver, self._library, self._kernel = driver, library, kernel

    def _prepare(self, device_index: int) -> None:
        """Allow the kernel its dynamic shared memory (over 48 KB needs opting in) on this device."""
        if self._kernel is None:
            self.load()
        driver = self._driver
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (result,) = driver.cuKernelSetAttribute(attribute, self._smem_bytes, self._kernel, device_index)
        _driver_check(result, f"setting {self._smem_bytes} bytes of dynamic shared memory")
        self._ready_devices.add(device_index)

    def __call__(self, q, k, v, out, lse) -> None:
        device_index = q.device.index
        if device_index not in self._ready_devices:
            with self._lock:
                if device_index not in self._ready_devices:
                    self._prepare(device_index)
        batch, seqlen_q, heads_q, _ = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
        stream = self._current_stream(device_index)
        grid_m = (seqlen_q + self._tile_m - 1) // self._tile_m
        with self._lock:
            _PARAMS.pack_into(self._params, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                              lse.data_ptr(), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                              *out.stride()[:3], seqlen_q, seqlen_k, heads_q, heads_q // heads_kv)
            (result,) = self._driver.cuLaunchKernel(self._kernel, grid_m, heads_q, batch, self._threads, 1, 1,
                                                    self._smem_bytes, stream, self._param_pointers_address, 0)
        if result != self._driver.CUresult.CUDA_SUCCESS:
            _driver_check(result, "launching the kernel")
