"""Ad hoc: fa_gen.fp8.transpose_v (templates/common/transpose_v.py.j2) against a clone of the same
bytes, and bit-equality with the PyTorch layout. `python bench/transpose_v_speed.py` on a GPU."""
import time

import torch

from fa_gen import fp8


def host_and_gpu_us(fn, calls: int = 20, sleep_cycles: int = 20_000_000) -> tuple[float, float]:
    """(host us a call without synchronisation, GPU us a call with the host hidden behind a queued sleep)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda._sleep(sleep_cycles)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return host * 1e6, start.elapsed_time(end) / calls * 1e3


# Fixed-length V: the kernel against a clone of the same bytes (GPU time, host hidden).
for shape in [(2, 8192, 16, 128), (1, 32768, 8, 128), (4, 4096, 8, 256), (8, 1000, 8, 80)]:
    v = torch.randn(*shape, device="cuda").to(fp8.E4M3)
    same = torch.equal(fp8.transpose_v(v).view(torch.uint8), fp8._transpose_torch(v).view(torch.uint8))
    _, transpose_us = host_and_gpu_us(lambda: fp8.transpose_v(v), calls=50)
    _, clone_us = host_and_gpu_us(lambda: v.view(torch.uint8).clone(), calls=50)
    moved = 2 * v.numel()
    print(shape, "equal", same, f"transpose {transpose_us:.1f} us {moved / transpose_us / 1e3:.0f} GB/s; "
          f"clone {clone_us:.1f} us {moved / clone_us / 1e3:.0f} GB/s", flush=True)

# Varlen: 8 documents of mixed lengths summing to 16k keys, 8 kv heads, d128 (tile_n 224), the kernel
# against the PyTorch path.
lengths = torch.tensor([4096, 1000, 3000, 517, 2048, 3500, 1200, 1023])
cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
v = torch.randn(int(cu[-1]), 8, 128, device="cuda").to(fp8.E4M3)
vt, offsets = fp8.transpose_v_varlen(v, cu, 224)
slots = vt.shape[0]
torch_path = lambda: fp8._transpose_varlen_torch(v, cu, (cu[1:] - cu[:-1]).long(), offsets.long(), slots)  # noqa: E731
same = torch.equal(vt.view(torch.uint8), torch_path()[0].view(torch.uint8))
for name, fn in (("varlen kernel", lambda: fp8.transpose_v_varlen(v, cu, 224)), ("varlen PyTorch ops", torch_path)):
    host, gpu = host_and_gpu_us(fn)
    print(f"{name}: equal {same}; GPU {gpu:.1f} us/call (host hidden), host {host:.0f} us/call", flush=True)

# The fp8 forward's call path at d128 8k against the kernel alone.
import fa_gen  # noqa: E402
from fa_gen.spec_load import load_spec  # noqa: E402

spec = load_spec({"name": "probe_fp8_d128", "dtype": "fp8_e4m3", "head_dim": 128, "mask": "none"})
kernel = fa_gen.build(spec)
q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda").to(fp8.E4M3) for _ in range(3))
scales = [torch.ones(2, 16, device="cuda") for _ in range(3)]
call = lambda: kernel.forward(q, k, v, descales=scales)  # noqa: E731
out = torch.empty(2, 8192, 16, 128, dtype=torch.bfloat16, device="cuda")
lse = torch.empty(2, 16, 8192, dtype=torch.float32, device="cuda")
operands = kernel._operands(q, k, v, out, lse, scales)
alone = lambda: kernel._function(*operands)  # noqa: E731
for name, fn in (("call", call), ("kernel alone", alone)):
    host, gpu = host_and_gpu_us(fn, calls=50, sleep_cycles=200_000_000)
    print(f"{name}: host {host:.0f} us/call; GPU time with the host hidden {gpu:.0f} us", flush=True)
