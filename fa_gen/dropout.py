"""Attention dropout: the `forward_dropout` and `backward_dropout` kinds and their varlen kinds
(the sm90 family's on Hopper where its kernels serve the spec, fa_gen.families.sm90_backward's
dropout_reasons; the sm80 family's elsewhere).

    seed, offset = draw_rng_state(q.device)             # from PyTorch's CUDA generator
    out, lse = forward_dropout(spec, q, k, v, 0.1, seed, offset)
    dq, dk, dv = backward_dropout(spec, dout, q, k, v, out, lse, 0.1, seed, offset)
    out, lse = forward_varlen_dropout(spec, q, k, v, cu_q, cu_k, max_q, max_k, 0.1, seed, offset)
    dq, dk, dv = backward_varlen_dropout(spec, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.1, seed, offset)

A packed (varlen) batch draws sequence b's mask as batch entry b: query and key positions are
positions inside the sequence, as masks see them.

Each probability is kept with probability 1 - p' and then scaled by 1 / (1 - p'), p' being p
rounded to a multiple of 1/256 (fa_gen.philox.effective_p: the mask draws a byte a score);
which ones are kept is Philox4x32-10 of (seed, offset, batch, head, query and key position) under the mapping
of fa_gen/philox.py, so a backward regenerates the same mask and fa_gen.reference reproduces it
bit for bit (`attention_reference(..., dropout=Dropout(p, seed, offset))`). The LSE is the
undropped one. p, seed and offset are runtime values: one compiled kernel serves every draw.

The backward regenerates the mask from the same (p, seed, offset): dV takes the dropped,
rescaled probabilities, dS = P * (Z * dP - D) with Z = keep / (1 - p') and D = rowsum(dO * O).

CUDA graphs. `seed` may also be an int64 device tensor holding (seed, offset), with offset
None: the kernels read the pair on the device. Under stream capture the public dropout path
(fa_gen.api.dropout) takes its pair from `graph_rng_state`: a snapshot of fa_gen's per-device
state, which the captured graph then advances, so each replay draws a new mask and the
backward regenerates the forward's.

This is the kernel layer; the public `dropout_p` arguments (fa_gen.attention, flash_attn_func)
are fa_gen.api.dropout's.
"""

from __future__ import annotations

import functools

import torch

from . import varlen_backward
from .backward import Backward, _workspace
from .errors import InputError, UnsupportedError
from .families.warp_tiles import padded_head_dim
from .inference import _check_varlen, _varlen_extra_arguments
from .philox import drop_threshold, rescale
from .runtime import build, current_arch, load_target
from .spec import Spec
from .target import resolve_target

KIND = "forward_dropout"
BACKWARD_KIND = "backward_dropout"
# The offset advances by this much per call: every call draws from counters of its own.
OFFSET_STEP = 4
# Where fa_gen's graph state starts past the generator's offset when it is made: eager draws
# (OFFSET_STEP each) and graph replays use disjoint offsets for the first 2^38 eager calls.
GRAPH_OFFSET_GAP = 1 << 40
# Per device index: (seed, offset) int64, advanced by captured graphs (graph_rng_state).
_GRAPH_STATES: dict[int, torch.Tensor] = {}


def draw_rng_state(device: torch.device, generator: torch.Generator | None = None) -> tuple[int, int]:
    """(seed, offset) for one dropout call from `generator` (default: the device's CUDA
    generator), advancing its offset so that the next call draws a different mask and
    `torch.manual_seed` reproduces a run."""
    if generator is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    offset = generator.get_offset()
    generator.set_offset(offset + OFFSET_STEP)
    return generator.initial_seed(), offset


def prepare_graph_rng(device: torch.device, generator: torch.Generator | None = None) -> None:
    """Make fa_gen's per-device dropout state for CUDA graphs (once, outside capture): seeded
    from `generator` (default: the device's CUDA generator), its offset GRAPH_OFFSET_GAP past
    the generator's. The public dropout path calls this on every eager call, so the warm-up
    steps a capture needs anyway make it."""
    index = _device_index(device)
    if index not in _GRAPH_STATES:
        generator = generator or torch.cuda.default_generators[index]
        seed, offset = generator.initial_seed(), generator.get_offset() + GRAPH_OFFSET_GAP
        _GRAPH_STATES[index] = torch.tensor([_signed64(seed), _signed64(offset)], dtype=torch.int64,
                                            device=torch.device("cuda", index))


def graph_rng_state(device: torch.device) -> torch.Tensor:
    """Under stream capture: (seed, offset) for one dropout call as an int64 device tensor, a
    copy of the device's graph state taken in the graph, whose offset the graph then advances
    by OFFSET_STEP (so every replay reads the offset the previous one left)."""
    state = _GRAPH_STATES.get(_device_index(device))
    if state is None:
        raise UnsupportedError("dropout in a CUDA graph captured before any eager dropout call on this device", [
            "run one eager step with dropout before capturing (the warm-up torch.cuda.graph needs anyway), or "
            "call fa_gen.dropout.prepare_graph_rng(device) first"])
    snapshot = state.clone()
    state[1:].add_(OFFSET_STEP)
    return snapshot


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def forward_dropout(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                    seed: int | torch.Tensor, offset: int | None, inputs=None, arch: str | None = None,
                    family: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of fixed-length q (b, sq, hq, d), k/v (b, sk, hkv, d) with the probabilities
    dropped with probability `dropout_p` under the generator state (seed, offset); `family`
    forces a template family (tests: the sm80 kernel on Hopper too)."""
    _check_draw(dropout_p, seed, offset)
    arch = arch or current_arch()
    # The preferred family's dropout forward; the mask is the mapping's, so any backward pairs with it.
    kernel = build(spec, arch, family=family or resolve_target(spec, arch, KIND).family.name)
    function = kernel._variant_function(KIND)
    kernel._check(q, k, v)
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, spec.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if seqlen_q == 0:
        return out, lse
    extra = kernel._plan_for_call(q, k, inputs).arguments if (spec.inputs or inputs or spec.mask_expr) else ()
    function(q, k, v, out, lse, *_draw_arguments(dropout_p, seed, offset, q.device), *extra)
    return out, lse


def backward_dropout(spec: Spec, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, dropout_p: float, seed: int | torch.Tensor,
                     offset: int | None, deterministic: bool = False, inputs=None, arch: str | None = None,
                     family: str | None = None):
    """(dq, dk, dv) of forward_dropout's output `out` (with its `lse`) for the upstream `dout`,
    under the same (dropout_p, seed, offset); `family` forces a template family (tests)."""
    _check_draw(dropout_p, seed, offset)
    backward = _backward(spec, arch or current_arch(), family)
    backward._check(dout, q, k, v, out, lse)
    extra = backward._extra_arguments(q, k, inputs, None)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    workspace = _workspace(q, padded_head_dim(spec.head_dim_qk))
    backward._function(q, k, v, out, dout, lse, dq, dk, dv, *workspace, int(bool(deterministic)),
                       *_draw_arguments(dropout_p, seed, offset, q.device), *extra)
    return dq, dk, dv


def forward_varlen_dropout(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                           seed: int | torch.Tensor, offset: int | None, inputs=None, arch: str | None = None,
                           family: str | None = None):
    """(out (total_q, hq, d_v), lse (hq, total_q)) of a packed batch (fa_gen.inference's layouts)
    with dropout; sequence b draws its mask as batch entry b."""
    _check_draw(dropout_p, seed, offset)
    _check_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, max_seqlen_k)
    # The preferred family's (Hopper's own where it serves the spec's varlen forward).
    function, _ = load_target(resolve_target(spec, arch or current_arch(), "forward_varlen_dropout", family))
    out = torch.empty((q.shape[0], q.shape[1], spec.head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0 or cu_seqlens_q.shape[0] < 2:
        return out, lse.fill_(-float("inf"))
    sequences = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_k, 0, max(int(max_seqlen_q), 1))
    function(q, k, v, out, lse, *sequences, *_draw_arguments(dropout_p, seed, offset, q.device),
             *_varlen_extra_arguments(spec, q, q.shape[1], inputs))
    return out, lse


def backward_varlen_dropout(spec: Spec, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, seed: int | torch.Tensor,
                            offset: int | None, deterministic: bool = False, inputs=None,
                            arch: str | None = None, family: str | None = None):
    """(dq, dk, dv) of forward_varlen_dropout's output under the same (dropout_p, seed, offset),
    by `family`'s kernel or else the preferred family's (Hopper's own where it serves the spec)."""
    _check_draw(dropout_p, seed, offset)
    _check_varlen(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, max_seqlen_k)
    varlen_backward._check_outputs(spec, q, out, dout, lse)
    family_name, function = varlen_backward.kernel_function(spec, arch or current_arch(), "backward_varlen_dropout",
                                                            family)
    batch = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or k.shape[0] == 0 or batch == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = varlen_backward._gradients(family_name, q, k, v, False)
    sequences = (cu_seqlens_q, cu_seqlens_k, cu_seqlens_k, 0, max(int(max_seqlen_q), 1), max(int(max_seqlen_k), 1))
    workspace = varlen_backward._workspace(q, batch, padded_head_dim(spec.head_dim_qk))
    function(q, k, v, out, dout, lse, dq, dk, dv, *workspace, int(bool(deterministic)),
             *_draw_arguments(dropout_p, seed, offset, q.device), *sequences,
             *_varlen_extra_arguments(spec, q, q.shape[1], inputs))
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def _backward(spec: Spec, arch: str, family: str | None = None) -> Backward:
    """The compiled backward_dropout kind of `family`, else of the first family that renders it
    (Hopper's own in its narrow layout, fa_gen.families.sm90_backward.dropout_reasons; the sm80
    family's elsewhere), with the backward's checks and plans."""
    function, info = load_target(resolve_target(spec, arch, BACKWARD_KIND, family))
    return Backward(spec, arch, function, info)


def _check_draw(dropout_p, seed, offset) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 < dropout_p < 1.0:
        raise InputError(f"dropout_p must be a number in (0, 1); got {dropout_p!r} (0 means no dropout: call "
                         "the plain forward)")
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.shape != (2,) or not seed.is_contiguous() or offset is not None:
            raise InputError("a device draw is a contiguous (2,) int64 tensor (seed, offset), passed as seed with "
                             f"offset None; got {tuple(seed.shape)} {seed.dtype}, offset {offset!r}")
        return
    for name, value in (("seed", seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
            raise InputError(f"{name} must be an int in [0, 2^64); got {value!r}")


def _draw_arguments(dropout_p: float, seed, offset, device) -> tuple:
    """The kernels' dropout arguments: (seed, offset) as an int64 device tensor (`seed` itself
    when it is one), the drop threshold, 1 / (1 - p') (fa_gen.philox: p rounded to 1/256)."""
    if isinstance(seed, torch.Tensor):
        rng = seed
    else:
        rng = torch.tensor([_signed64(seed), _signed64(offset)], dtype=torch.int64, device=device)
    return rng, drop_threshold(dropout_p), rescale(dropout_p)


def _signed64(value: int) -> int:
    """A uint64 as the int64 with the same bits (what an int64 tensor holds)."""
    return value - (1 << 64) if value >= 1 << 63 else value
