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
