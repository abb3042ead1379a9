"""Ad hoc: fa_gen.fp8.transpose_v (templates/common/transpose_v.py.j2) against a clone of the same
bytes, and bit-equality with the PyTorch layout. `python bench/transpose_v_speed.py` on a GPU."""
import torch, time
from fa_gen import fp8
for shape in [(2, 8192, 16, 128), (1, 32768, 8, 128), (4, 4096, 8, 256), (8, 1000, 8, 80)]:
    v = torch.randn(*shape, device="cuda").to(fp8.E4M3)
    got = fp8.transpose_v(v); want = fp8._transpose_torch(v)
    ok = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    def t(fn, n=50):
        fn(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(n): fn()
        e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n
    ms = t(lambda: fp8.transpose_v(v)); ms_copy = t(lambda: v.view(torch.uint8).clone())
    nbytes = 2 * v.numel()
    print(shape, "equal", ok, f"transpose {ms*1e3:.1f} us {nbytes/ms/1e6:.0f} GB/s; clone {ms_copy*1e3:.1f} us {nbytes/ms_copy/1e6:.0f} GB/s", flush=True)

# The fp8 forward's call path at d128 8k: host time per call (no synchronisation), and the GPU time
# of the call with the host hidden behind a queued sleep, against the kernel alone.
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
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        fn()
    host = (time.perf_counter() - t0) / 100
    torch.cuda.synchronize()
    hidden = []
    for _ in range(20):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda._sleep(2_000_000)
        s.record()
        fn()
        e.record()
        e.synchronize()
        hidden.append(s.elapsed_time(e))
    print(f"{name}: host {host * 1e6:.0f} us/call; GPU time with the host hidden {sorted(hidden)[10] * 1e3:.0f} us", flush=True)
