"""Runtime: build a kernel for a spec, validate tensors, call it.

`build()` does the slow path once (load spec, render, compile or load from the
disk cache); the returned `Kernel` keeps the per-call path short: a few
attribute checks, two allocations and one TVM-FFI call, which reads PyTorch's
current stream itself.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import archs, env, fp8
from .backends import get_backend
from .cache import CacheKey, default_cache
from .toolchain import canonical_json, fingerprint_hash, sha256_text
from .errors import InputError, UnsupportedError
from .plan import CallPlan, make_plan, memoised_plan
from .spec import DType, Spec
from .spec_load import load_spec
from .target import Target, resolve_target

_TORCH_DTYPES = {DType.FP16: torch.float16, DType.BF16: torch.bfloat16, DType.FP8_E4M3: fp8.E4M3}
# Strides (in bytes) must keep every 128-bit vector load aligned.
_STRIDE_ALIGN_BYTES = 16


@dataclass(frozen=True)
class BuildInfo:
    """What the slow path did: for the CLI and for measurements."""

    arch: str
    family: str
    entry_dir: Path | None
    source_filename: str
    seconds: float
    compiled: bool   # False when the object came from the disk or memory cache
    target: Target | None = None  # what was built (None: a BuildInfo made by hand, family by name)


class CompiledKernel:
    """A loaded kernel of one spec on one arch, with what built it; subclasses add the call."""

    def __init__(self, spec: Spec, arch: str, function, info: BuildInfo):
        self.spec = spec
        self.arch = arch
        self.info = info
        # The family that rendered this kernel, decided when its Target was resolved (None for
        # a kernel object made by hand without a build, as tests of the input checks do).
        self.family = _family_of(info)
        self._function = function
        self._dtype = _TORCH_DTYPES[spec.dtype]
        self._out_dtype = _TORCH_DTYPES[spec.output_dtype]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.name!r}, arch={self.arch!r}, family={self.info.family!r})"


def _family_of(info: BuildInfo | None):
    if info is None:
        return None
    return info.target.family if info.target is not None else archs.family_named(info.family)


class Kernel(CompiledKernel):
    """A compiled forward kernel for one spec on one arch. Call as `out, lse = kern(q, k, v)`."""

    def __init__(self, spec: Spec, arch: str, function, info: BuildInfo):
        super().__init__(spec, arch, function, info)
        # Plans of masks that read no tensor, by shapes, device and scalars (fa_gen.plan).
        self._plans: dict[tuple, CallPlan] = {}
        # Other forward kernels of the family, for calls no longer than their seqlen bound
        # (Family.forward_variants): [(max_seqlen, kind)], shortest first; loaded on first use.
        self._variants = self.family.forward_variants(spec, arch)
        self._variant_functions: dict[str, object] = {}
        # Layouts (shape, strides, dtype, device, alignment of q, k, v) that passed _check: a call
        # with one of them again skips the checks (about 10 of their 18 us on an H100's host).
        self._checked: set[tuple] = set()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs=None):
        out, lse = self.forward(q, k, v, inputs=inputs)
        return (out, lse) if self.spec.return_lse else out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None, inputs=None,
                plan: CallPlan | None = None, descales=None):
        """(out, lse) always; `out`/`lse` may be given preallocated (tests poison them).

        `inputs`: name -> tensor or number for the spec's declared inputs (fa_gen.variant);
        or `plan`: those inputs checked and classified once by `self.plan` (fa_gen.plan).
        `descales`: fp8 specs only, (q_descale, k_descale, v_descale) (Fp8Kernel).
        """
        self._check(q, k, v)
        batch, seqlen_q, heads_q, _ = q.shape
        # new_empty: about half of torch.empty(shape, dtype=, device=)'s host time.
        if out is None:
            out = q.new_empty((batch, seqlen_q, heads_q, self.spec.head_dim_v), dtype=self._out_dtype)
        if lse is None:
            lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
        operands = self._operands(q, k, v, out, lse, descales)
        if plan is None and not (self.spec.inputs or inputs or self.spec.mask_expr):
            if seqlen_q > 0:
                self._function_for(seqlen_q, k.shape[1])(*operands)
            return out, lse
        if plan is None:
            plan = self._plan_for_call(q, k, inputs)
        else:
            if inputs is not None:
                raise InputError("pass inputs or a plan (which holds its inputs), not both")
            plan.check_call(self.spec, self._tiles, q, k)
        if seqlen_q > 0:
            self._function_for(seqlen_q, k.shape[1])(*operands, *plan.arguments)
        return out, lse

    def _operands(self, q, k, v, out, lse, descales) -> tuple:
        """The kernel's leading arguments."""
        if descales is not None:
            raise InputError(f"descale factors are for fp8 specs; {self.spec.name!r} is {self.spec.dtype.value}")
        return q, k, v, out, lse

    def kind_for(self, seqlen_q: int, seqlen_k: int) -> str:
        """The forward kind that serves a call with these seqlens ("forward" or a variant's)."""
        longest = max(seqlen_q, seqlen_k)
        return next((kind for max_seqlen, kind in self._variants if longest <= max_seqlen), "forward")

    def load_variants(self) -> list[str]:
        """Compile or load every forward variant now (precompile), not on its first call."""
        kinds = [kind for _, kind in self._variants if kind != "forward"]
        for kind in kinds:
            self._variant_function(kind)
        return kinds

    def pinned(self, kind: str) -> "Kernel":
        """This kernel with every call served by the `kind` kernel (tests, comparisons)."""
        if kind != "forward" and kind not in (k for _, k in self._variants):
            raise InputError(f"spec {self.spec.name!r} has no {kind!r} kernel in family {self.info.family}; "
                             f"it has forward{''.join(', ' + k for _, k in self._variants if k != 'forward')}")
        function = self._function if kind == "forward" else self._variant_function(kind)
        kernel = type(self)(self.spec, self.arch, function, self.info)
        kernel._variants = []
        return kernel

    def _function_for(self, seqlen_q: int, seqlen_k: int):
        if not self._variants:
            return self._function
        kind = self.kind_for(seqlen_q, seqlen_k)
        return self._function if kind == "forward" else self._variant_function(kind)

    def _variant_function(self, kind: str):
        function = self._variant_functions.get(kind)
        if function is None:
            function, _ = load_target(Target(self.spec, self.arch, self.family, kind))
            self._variant_functions[kind] = function
        return function

    def plan(self, q: torch.Tensor, k: torch.Tensor, inputs=None) -> CallPlan:
        """The spec's inputs checked, and its mask expression classified, for calls with q's
        and k's shapes: pass it as `forward(..., plan=...)` to skip that work per call."""
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise InputError(f"{name} must be a 4-D torch.Tensor (batch, seqlen, heads, head_dim)")
        return make_plan(self.spec, self._tiles, q, k, inputs)

    @functools.cached_property
    def _tiles(self) -> tuple[int, int]:
        """(tile_m, tile_n) of this kernel's forward: what the mask classification is made for."""
        if self.spec.mask_expr is None:
            return (0, 0)
        return self.family.forward_tiles(self.spec, self.arch)

    def _plan_for_call(self, q: torch.Tensor, k: torch.Tensor, inputs) -> CallPlan:
        return memoised_plan(self._plans, self.spec, q, k, inputs,
                             lambda q, k, inputs: make_plan(self.spec, self._tiles, q, k, inputs))

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        key = _layout_key(q, k, v)
        if key in self._checked:
            return
        self._check_inputs(q, k, v)
        if key is not None:
            if len(self._checked) >= _CHECKED_LAYOUTS:
                self._checked.clear()
            self._checked.add(key)

    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        spec = self.spec
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self._dtype:
                raise InputError(f"{name} has dtype {t.dtype}; spec {spec.name!r} was built for {self._dtype}")
            if t.dim() != 4:
                raise InputError(f"{name} must be 4-D (batch, seqlen, heads, head_dim); got shape {tuple(t.shape)}")
            _check_strides(name, t)
        _check_shapes(spec, q, k, v)
        # Device last: every other check above can then be tested without a GPU.
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not t.is_cuda:
                raise InputError(f"{name} is on {t.device}; fa_gen kernels need CUDA tensors")
        if not (q.device == k.device == v.device):
            raise InputError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


class Fp8Kernel(Kernel):
    """The forward of an fp8 spec: e4m3 q, k, v, and per-(batch, kv head) descale factors
    (`forward(..., descales=(q_descale, k_descale, v_descale))`, each None for 1). V goes to the
    kernel transposed (fa_gen.fp8.transpose_v, one launch per call, or none when V comes in that
    layout already); O is in the spec's out_dtype."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs=None, descales=None):
        out, lse = self.forward(q, k, v, inputs=inputs, descales=descales)
        return (out, lse) if self.spec.return_lse else out

    def _check(self, q, k, v) -> None:
        """V as given, or already in the kernel's layout (fa_gen.fp8.transpose_v's result, made once
        where V is reused: a prefix cache, say), which is then passed on as it is."""
        if not fp8.is_transposed(v):
            return super()._check(q, k, v)
        super()._check(q, k, k if self.spec.head_dim_v == self.spec.head_dim_qk else
                       k.new_empty(*k.shape[:3], self.spec.head_dim_v))
        fp8.check_transposed(v, k, self.spec.head_dim_v)

    def _operands(self, q, k, v, out, lse, descales) -> tuple:
        scales = fp8.descale_tensors(descales, k.shape[0], k.shape[2], q.device)
        vt = v if fp8.is_transposed(v) else fp8.transpose_v(v, self.arch)
        return (q, k, vt, out, lse, *scales)


# Layouts a kernel remembers as checked (then it forgets them all and starts again).
_CHECKED_LAYOUTS = 256


def _layout_key(*tensors) -> tuple | None:
    """What Kernel._check reads of each tensor: shape, strides, dtype, device and the data's
    alignment to 16 bytes (None when one is not a tensor: those are checked every time)."""
    try:
        return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % _STRIDE_ALIGN_BYTES == 0)
                     for t in tensors)
    except (AttributeError, TypeError):
        return None


def _check_strides(name: str, t: torch.Tensor) -> None:
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise InputError(f"{name} is a broadcast view (strides {t.stride()}, shape {tuple(t.shape)}): the kernels "
                         "read every row where its stride says; pass the tensor it was expanded from (K/V over "
                         "query heads: k[:, :, :1] is MQA) or .contiguous() (fa_gen.attention does the latter)")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InputError(f"{name} must have a contiguous last dimension; got strides {t.stride()}")
    align = _STRIDE_ALIGN_BYTES // t.element_size()
    if any(s % align for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise InputError(f"{name}: strides {t.stride()} (elements) must be multiples of {align} "
                         "and the data 16-byte aligned; call .contiguous() first")


def _check_shapes(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    bq, _, hq, dq = q.shape
    bk, sk, hk, dk = k.shape
    bv, sv, hv, dv = v.shape
    if dq != spec.head_dim_qk or dk != spec.head_dim_qk:
        raise InputError(f"q and k head_dim must be {spec.head_dim_qk} (spec {spec.name!r}); got {dq} and {dk}")
    if dv != spec.head_dim_v:
        raise InputError(f"v head_dim must be {spec.head_dim_v} (spec {spec.name!r}); got {dv}")
    if not bq == bk == bv:
        raise InputError(f"batch sizes differ: q {bq}, k {bk}, v {bv}")
    if sk != sv or hk != hv:
        raise InputError(f"k and v must agree in seqlen and heads: k {tuple(k.shape)}, v {tuple(v.shape)}")
    if sk == 0:
        raise InputError("seqlen_k must be at least 1")
    if hk == 0 or hq % hk:
        raise InputError(f"heads of q ({hq}) must be a multiple of heads of k/v ({hk}) (GQA/MQA)")


# Arch of each CUDA device index, once looked up: every call's path asks (the device's properties
# cost about 20 us a call on the host).
_DEVICE_ARCHS: dict[int, str] = {}


def current_arch() -> str:
    """The compile target: FA_GEN_ARCH if set, else the current CUDA device's."""
    override = env.target_arch()
    if override:
        archs.arch_info(override)  # unknown names fail here, with the known list
        return override
    if not torch.cuda.is_initialized() and not torch.cuda.is_available():
        raise UnsupportedError("no target arch", ["no CUDA device is visible; pass arch= or set FA_GEN_ARCH "
                                                  "(e.g. sm_90a) to compile without a GPU"])
    index = torch.cuda.current_device()
    arch = _DEVICE_ARCHS.get(index)
    if arch is None:
        arch = _DEVICE_ARCHS[index] = archs.arch_for_capability(*torch.cuda.get_device_capability(index))
    return arch


# Built kernels of this process, keyed by (what the caller passed, arch): the
# one-liner `attention()` then costs a dict lookup, not a YAML parse.
_KERNELS: dict[tuple[object, str, str | None], Kernel] = {}


def build(spec: Spec | str | os.PathLike, arch: str | None = None, family: str | None = None) -> Kernel:
    """Load `spec` (a Spec, a YAML path, or a shipped spec's name), then compile or load its kernel.

    `family` forces a template family (e.g. "sm80" on a Hopper GPU, for comparisons);
    by default the arch registry picks the preferred one.
    """
    arch = arch or current_arch()
    memo_key = (spec if isinstance(spec, Spec) else os.fspath(spec), arch, family)
    kernel = _KERNELS.get(memo_key)
    if kernel is None:
        kernel = _build_uncached(resolve_spec(spec), arch, family)
        _KERNELS[memo_key] = kernel
    return kernel


def resolve_spec(spec: Spec | str | os.PathLike) -> Spec:
    if isinstance(spec, Spec):
        return spec
    path = Path(spec)
    if not path.exists() and path.suffix == "":
        from .paths import specs_dir

        shipped = specs_dir() / f"{spec}.yaml"
        if shipped.exists():
            path = shipped
    return load_spec(path)


def _build_uncached(spec: Spec, arch: str, family_name: str | None) -> Kernel:
    function, info = load_kernel_function(spec, arch, family_name, kind="forward")
    return (Fp8Kernel if spec.is_fp8 else Kernel)(spec, arch, function, info)


def load_kernel_function(spec: Spec, arch: str, family_name: str | None = None, kind: str = "forward"):
    """Render, then compile or load from the cache, the `kind` kernel of the family called
    `family_name` or else the first that renders it: (callable, BuildInfo)."""
    return load_target(resolve_target(spec, arch, kind, family_name))


def load_target(target: Target):
    """Render `target`, then compile it or load it from the cache: (callable, BuildInfo)."""
    spec, arch, family, kind = target.spec, target.arch, target.family, target.kind
    if not archs.named_by(arch, spec.archs):
        raise UnsupportedError(f"spec {spec.name!r} on {arch}",
                               [f"the spec targets {', '.join(spec.archs)}; add {arch} to its archs"])
    backend = get_backend(family.backend)
    fields = {"spec": spec.canonical_json(), "family": family.name, "backend": family.backend,
              "options": backend.compile_options(arch)}
    cache = default_cache()
    start = time.perf_counter()
    # Warm start: the entry this target rendered to before (same toolchain fingerprint, so the
    # same sources and templates), loaded without rendering.
    toolchain = fingerprint_hash()
    target_key = sha256_text(canonical_json({"kind": kind, "arch": arch, **fields}))
    indexed = None if env.dump_dir() else cache.get_indexed(toolchain, arch, target_key, backend.load_object)
    if indexed is not None:
        function, record = indexed
        return function, BuildInfo(arch=arch, family=family.name, entry_dir=cache.root / record["entry"],
                                   source_filename=record.get("filename") or target.files[1],
                                   seconds=time.perf_counter() - start,
                                   compiled=False, target=target)
    from .render import render_target  # Jinja: only where a source must be rendered

    rendered = render_target(target)
    _dump_source(spec, rendered)
    key = CacheKey.for_source(uri=f"{spec.name}_{kind}", arch=arch, kind=kind, source=rendered.text,
                              fields=fields, toolchain=toolchain)
    builds_before = cache.stats.builds
    function = cache.get_or_build(
        key, rendered.text,
        build=lambda source, path: backend.compile_to_object(source, arch, path, label=f"{spec.name} {kind}"),
        load=backend.load_object,
    )
    cache.index(target_key, key, filename=rendered.filename)
    info = BuildInfo(arch=arch, family=family.name, entry_dir=cache.stats.last_entry,
                     source_filename=rendered.filename, seconds=time.perf_counter() - start,
                     compiled=cache.stats.builds > builds_before, target=target)
    return function, info


def _dump_source(spec: Spec, rendered) -> None:
    dump_dir = env.dump_dir()
    if dump_dir:
        target = Path(dump_dir) / spec.name / rendered.arch
        target.mkdir(parents=True, exist_ok=True)
        (target / rendered.filename).write_text(rendered.text)
