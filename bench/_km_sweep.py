import torch
from pqattn.kernels import kmeans
x = torch.randn(16, 32768, 64, device="cuda"); c = torch.randn(16, 64, 64, device="cuda")
nv = torch.full((16,), 32768, dtype=torch.int32, device="cuda")
for P in (17, 33):
    for cfg in kmeans.KMEANS_CONFIGS:
        codes = torch.empty(16, 32768, dtype=torch.int32, device="cuda"); dist = torch.empty(16, 32768, device="cuda")
        sums = torch.empty(16, P, 64, 64, device="cuda"); counts = torch.empty(16, P, 64, device="cuda")
        f = lambda: kmeans.kmeans_step(x[:, None], 1, c, nv, codes=codes, dist=dist, sums=sums, counts=counts, config=cfg)
        f(); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20): f()
        e1.record(); torch.cuda.synchronize()
        print("tf32x3 step P", P, cfg.kwargs, cfg.num_warps, f"{e0.elapsed_time(e1) / 20 * 1e3:.1f} us", flush=True)
