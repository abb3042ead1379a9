"""Ad hoc: where the fp8 forward call path spends host time (per piece, then cProfile). GPU only."""
import cProfile, pstats, time, torch, io
import fa_gen
from fa_gen import fp8
from fa_gen.spec_load import load_spec
spec = load_spec({"name": "probe_fp8_d128", "dtype": "fp8_e4m3", "head_dim": 128, "mask": "none"})
kernel = fa_gen.build(spec)
q, k, v = (torch.randn(1, 256, 16, 128, device="cuda").to(fp8.E4M3) for _ in range(3))
scales = [torch.ones(1, 16, device="cuda") for _ in range(3)]
def timeit(name, fn, n=300):
    for _ in range(5): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n; torch.cuda.synchronize()
    print(f"{name}: {dt*1e6:.1f} us", flush=True)
timeit("call", lambda: kernel.forward(q, k, v, descales=scales))
timeit("call, descales None", lambda: kernel.forward(q, k, v))
timeit("descale_tensors", lambda: fp8.descale_tensors(scales, 1, 16, q.device))
timeit("transpose_v", lambda: fp8.transpose_v(v, kernel.arch))
vt = fp8.transpose_v(v, kernel.arch)
timeit("call with V^T", lambda: kernel.forward(q, k, vt, descales=scales))
timeit("_check", lambda: kernel._check(q, k, v))
fn = fp8._transpose_kernel(kernel.arch)
vi, vti = v.view(torch.int32), torch.empty(1, 16, 128, 256, dtype=fp8.E4M3, device="cuda").view(torch.int32)
timeit("transpose kernel launch", lambda: fn(vi, vti))
timeit("empty", lambda: torch.empty(1, 16, 128, 256, dtype=fp8.E4M3, device="cuda"))
pr = cProfile.Profile(); pr.enable()
for _ in range(300): kernel.forward(q, k, v, descales=scales)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue())
