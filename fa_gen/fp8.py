"""fp8 (e4m3) inputs on the kernel path: V's layout for the kernel, descale tensors, quantisation.

The sm90 forward takes P V's B operand K-major (the only fp8 wgmma layout), so it reads V
transposed: keys contiguous, and within each block of 32 keys in `key_order`, the order its
P registers hold the keys in (templates/sm90/fp8.j2). `transpose_v` makes that tensor in one
copy; the kernel's O is then exactly P V.
"""

from __future__ import annotations

import functools

import torch

from .errors import InputError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Keys per block of the P-register order (the K of one fp8 wgmma).
KEY_BLOCK = 32


def key_order() -> list[int]:
    """For each position p of a 32-key block of V^T, the key it holds.

    With p = 16 h + 4 t + a (h the 16-key half, t the lane within its quad, a in 0..3), an fp8
    A fragment puts P[key] at p where the S accumulator of lane t holds key 8 (2 h + a // 2) +
    2 t + a % 2: bits (p4, p3, p2, p1, p0) of p become bits (p4, p1, p3, p2, p0) of the key.
    """
    return [(p & 0b10001) | ((p & 0b00010) << 2) | ((p & 0b01100) >> 1) for p in range(KEY_BLOCK)]


def padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // KEY_BLOCK) * KEY_BLOCK


def transpose_v(v: torch.Tensor, arch: str | None = None) -> torch.Tensor:
    """(batch, seqlen_k, heads, d) e4m3 -> the kernel's V^T: a (batch, padded seqlen_k, heads, d)
    view whose keys are contiguous (storage (batch, heads, d, padded)), zero keys past seqlen_k,
    each 32-key block in key_order(). One launch of templates/common/transpose_v.py.j2 on a GPU
    (V read once, V^T written once; compiled for `arch`, by default v's device's); PyTorch ops elsewhere."""
    batch, seqlen_k, heads, dim = v.shape
    if _kernel_ready(v):
        from .archs import arch_for_capability

        vt = v.new_empty((batch, heads, dim, padded_keys(seqlen_k)), dtype=E4M3)  # less host time than torch.empty
        arch = arch or arch_for_capability(*torch.cuda.get_device_capability(v.device))
        _transpose_kernel(arch)(v.view(torch.int32), vt.view(torch.int32))
        return vt.permute(0, 3, 1, 2)
    return _transpose_torch(v)


def is_transposed(v) -> bool:
    """Whether `v` is in the kernel's layout (a transpose_v result): keys contiguous, not the head dim."""
    return isinstance(v, torch.Tensor) and v.dim() == 4 and v.stride(1) == 1 and v.stride(3) != 1


def check_transposed(vt: torch.Tensor, k: torch.Tensor, head_dim_v: int) -> None:
    """A pre-transposed V must be what transpose_v makes of a V shaped like k (head dim `head_dim_v`)."""
    batch, seqlen_k, heads = k.shape[:3]
    want = (batch, padded_keys(seqlen_k), heads, head_dim_v)
    if vt.dtype != E4M3 or tuple(vt.shape) != want or vt.device != k.device:
        raise InputError(f"a pre-transposed v must be fa_gen.fp8.transpose_v(v) of a v shaped like k: {want} "
                         f"{E4M3} on {k.device}; got {tuple(vt.shape)} {vt.dtype} on {vt.device}")
    storage = (heads * head_dim_v * want[1], 1, head_dim_v * want[1], want[1])
    if tuple(vt.stride()) != storage or vt.data_ptr() % 16:
        raise InputError(f"a pre-transposed v must have transpose_v's strides {storage}; got {vt.stride()}")


# The widest V row the transpose kernel's shared memory holds (its MAX_WORDS 32-bit words).
TRANSPOSE_MAX_DIM = 256


def _kernel_ready(v: torch.Tensor) -> bool:
    """A CUDA tensor whose rows the kernel reads as whole 16-byte words, d up to TRANSPOSE_MAX_DIM."""
    return (v.is_cuda and v.stride(-1) == 1 and v.data_ptr() % 16 == 0 and v.shape[-1] % 16 == 0
            and v.shape[-1] <= TRANSPOSE_MAX_DIM and all(s % 16 == 0 for s in v.stride()[:-1]) and v.numel() > 0)


@functools.lru_cache(maxsize=None)
def _transpose_kernel(arch: str, varlen: bool = False):
    from .helper_kernels import load_helper_kernel
    from .render import environment
    from .version import __version__

    source = environment().get_template("common/transpose_v.py.j2").render(
        fa_gen_version=__version__, max_words=TRANSPOSE_MAX_DIM // 4, varlen=varlen)
    name = "transpose_v_varlen" if varlen else "transpose_v"
    return load_helper_kernel(source, name, name, arch)


def _transpose_torch(v: torch.Tensor) -> torch.Tensor:
    """transpose_v in PyTorch ops: one pad and one permuted copy."""
    batch, seqlen_k, heads, dim = v.shape
    padded = padded_keys(seqlen_k)
    raw = v.view(torch.uint8)  # copy kernels need no fp8 support this way; 0x00 is +0.0
    if padded != seqlen_k:
        raw = torch.nn.functional.pad(raw, (0, 0, 0, 0, 0, padded - seqlen_k))
    # Key bits (n4, n3, n2, n1, n0) -> positions (n4, n2, n1, n3, n0), see key_order.
    blocks = raw.view(batch, padded // KEY_BLOCK, 2, 2, 2, 2, 2, heads, dim)
    vt = blocks.permute(0, 7, 8, 1, 2, 4, 5, 3, 6).reshape(batch, heads, dim, padded)
    return vt.view(E4M3).permute(0, 3, 1, 2)


def transpose_v_varlen(v: torch.Tensor, cu_seqlens_k: torch.Tensor, tile_n: int,
                       arch: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed batch's V (total_k, heads, d) e4m3 -> (V^T, offsets) for the varlen fp8 forward.

    V^T is a (slots, heads, d) view with the keys contiguous; sequence b's keys start at slot
    offsets[b] (int32, batch + 1 on the device), its region rounded up to whole `tile_n`-key tiles
    and zero past its keys (a key tile's load never reaches the next sequence), each 32-key block in
    key_order(). Device ops only (no host synchronisation): the slots are an upper bound made from
    shapes, total_k + batch * (tile_n - 1), rounded up to 32. On a GPU one kernel launch after the
    offsets' five small ops (templates/common/transpose_v.py.j2, varlen; compiled for `arch`, by
    default v's device's); PyTorch ops elsewhere."""
    total, heads, dim = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    device = v.device
    # Regions of whole key tiles and their offsets: five small ops, int32 (total_k fits).
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    regions = (lengths + (tile_n - 1)).div_(tile_n, rounding_mode="floor").mul_(tile_n)
    offsets = cu_seqlens_k.new_zeros(batch + 1, dtype=torch.int32)
    torch.cumsum(regions, 0, dtype=torch.int32, out=offsets[1:])
    slots = padded_keys(total + batch * (tile_n - 1))
    if (batch and total and _kernel_ready(v) and tile_n % KEY_BLOCK == 0 and cu_seqlens_k.dtype == torch.int32
            and cu_seqlens_k.is_contiguous()):
        # One launch: each 32-slot block bisects the offsets for its sequence (templates/common/transpose_v.py.j2).
        from .archs import arch_for_capability

        arch = arch or arch_for_capability(*torch.cuda.get_device_capability(device))
        vt = v.new_empty((heads, dim, slots), dtype=E4M3)
        _transpose_kernel(arch, True)(v.view(torch.int32).unsqueeze(0), vt.view(torch.int32).unsqueeze(0), offsets,
                                      cu_seqlens_k, max(batch - 1, 1).bit_length())
        return vt.permute(2, 0, 1), offsets
    return _transpose_varlen_torch(v, cu_seqlens_k, lengths.to(torch.int64), offsets.to(torch.int64), slots)


def _transpose_varlen_torch(v, cu_seqlens_k, lengths, offsets, slots):
    """transpose_v_varlen's V^T in PyTorch ops: every slot's source row gathered, then one permuted copy."""
    total, heads, dim = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    device = v.device
    slot = torch.arange(slots, device=device)
    sequence = torch.searchsorted(offsets[1:], slot, right=True).clamp(max=max(batch - 1, 0))
    position = slot - offsets[sequence]
    key = position // KEY_BLOCK * KEY_BLOCK + torch.tensor(key_order(), device=device)[position % KEY_BLOCK]
    valid = (slot < offsets[-1]) & (key < lengths[sequence]) if batch else torch.zeros_like(slot, dtype=torch.bool)
    source = torch.where(valid, cu_seqlens_k.to(torch.int64)[sequence] + key, 0)
    raw = v.view(torch.uint8)
    rows = raw[source] * valid[:, None, None].to(torch.uint8) if total else raw.new_zeros(slots, heads, dim)
    vt = rows.permute(1, 2, 0).contiguous()  # (heads, d, slots)
    return vt.view(E4M3).permute(2, 0, 1), offsets.to(torch.int32)


def descale_tensor(name: str, value, batch: int, heads_kv: int, device) -> torch.Tensor:
    """A descale argument as the kernel reads it: (batch, heads_kv) float32, contiguous, on `device`.
    None is 1; a number or a tensor that broadcasts to (batch, heads_kv) (FlashAttention-3's shape)."""
    if value is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Memory made during a capture belongs to the graph's pool: not kept past it.
            return torch.ones(batch, heads_kv, dtype=torch.float32, device=device)
        return _ones(batch, heads_kv, torch.device(device))
    if not isinstance(value, torch.Tensor):
        # A fill on the device: no host-to-device copy on the call path.
        return torch.full((batch, heads_kv), float(value), dtype=torch.float32, device=device)
    t = value
    if (t.dtype == torch.float32 and t.shape == (batch, heads_kv) and t.is_contiguous()
            and t.device == torch.device(device)):
        return t  # already what the kernel reads: no host work beyond these checks
    if not t.is_floating_point():
        raise InputError(f"{name} must be a float tensor or number; got dtype {t.dtype}")
    try:
        t = torch.broadcast_to(t, (batch, heads_kv))
    except RuntimeError:
        raise InputError(f"{name} has shape {tuple(t.shape)}; expected (batch, heads_kv) = ({batch}, {heads_kv}) "
                         "or a shape that broadcasts to it") from None
    if t.device.type == "cuda" and t.device != torch.device(device):
        raise InputError(f"{name} is on {t.device}; q is on {device}")
    return t.to(device=device, dtype=torch.float32).contiguous()


def descale_tensors(descales, batch: int, heads_kv: int, device) -> list[torch.Tensor]:
    """(q_descale, k_descale, v_descale), or None for all three, as the kernel reads them (descale_tensor)."""
    given = descales if descales is not None else (None, None, None)
    if len(given) != 3:
        raise InputError("descales must be (q_descale, k_descale, v_descale)")
    return [descale_tensor(name, value, batch, heads_kv, device)
            for name, value in zip(("q_descale", "k_descale", "v_descale"), given)]


@functools.lru_cache(maxsize=64)
def _ones(batch: int, heads_kv: int, device: torch.device) -> torch.Tensor:
    """Descale 1, made once per shape and device (read only, never written)."""
    return torch.ones(batch, heads_kv, dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, heads_kv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale): x (batch, seqlen, heads, d) in e4m3 and the float32 factor with x ~= x8 * descale,
    one per (batch, head) so that each head's largest magnitude is E4M3_MAX; with `heads_kv` (for q
    under GQA: the kernel takes one q descale per kv head), one per (batch, group of heads / heads_kv)."""
    if x.dim() != 4:
        raise InputError(f"quantize takes (batch, seqlen, heads, d); got shape {tuple(x.shape)}")
    batch, _, heads, _ = x.shape
    groups = heads_kv or heads
    if groups <= 0 or heads % groups:
        raise InputError(f"heads ({heads}) must be a multiple of heads_kv ({heads_kv})")
    amax = x.detach().abs().amax(dim=(1, 3)).float().view(batch, groups, heads // groups).amax(-1)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    per_head = descale.repeat_interleave(heads // groups, dim=1)
    x8 = (x.float() / per_head[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, descale


@functools.lru_cache(maxsize=16)
def rotation(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """(Made once per (head_dim, seed, device) and shared: read only.) An orthogonal (head_dim, head_dim) float32 matrix R = diag(signs) H for incoherent
    processing (FlashAttention-3, section 3.3): H the normalised Walsh-Hadamard matrix, block
    diagonal with blocks of the largest power of two dividing head_dim (64 at 192, 32 at 96), and
    the signs random +-1 from `seed`. (q R)(k R)^T = q k^T: the scores are unchanged, while a few
    outlier channels are spread over the block before e4m3 rounds them."""
    block = head_dim & -head_dim
    if head_dim <= 0 or block < 2:
        raise InputError(f"rotation: head_dim {head_dim} needs an even factor (its largest power-of-two divisor is {block})")
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    blocks = torch.block_diag(*[hadamard / block ** 0.5] * (head_dim // block))
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=generator, dtype=torch.float64) * 2 - 1
    return (signs[:, None] * blocks).float().to(device)


def quantize_qk_incoherent(q: torch.Tensor, k: torch.Tensor, seed: int = 0):
    """(q8, q_descale, k8, k_descale) of q and k rotated by the same `rotation(d, seed)` before
    quantize (q's descales one per kv head, as the kernel takes them). The fp8 kernel then computes
    the same scores from better-rounded inputs: for inputs whose magnitude sits in a few channels
    the scores' error falls (bench/fp8_accuracy.py). V is not rotated (O = P V needs it as it is)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] != k.shape[-1]:
        raise InputError(f"quantize_qk_incoherent takes q and k (batch, seqlen, heads, d) of one head dim; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    r = rotation(q.shape[-1], seed, q.device)
    q8, qd = quantize(q.float() @ r, heads_kv=k.shape[2])
    k8, kd = quantize(k.float() @ r)
    return q8, qd, k8, kd


def dequantize(x8: torch.Tensor, descale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """x8 * descale in `dtype`, with descale (batch, heads of x8 or fewer: one per group of heads)."""
    group = x8.shape[2] // descale.shape[1]
    per_head = descale.to(dtype).repeat_interleave(group, dim=1)
    return x8.to(dtype) * per_head[:, None, :, None]
