import torch, pqattn
from pqattn.index import PQConfig
from pqattn.lab import demo
from pqattn.lab.workload import WorkloadSpec
spec = WorkloadSpec()
cfg = PQConfig(subvectors=2, bits=6, sink=128, window=128, heavy=256, iters=10)
for i in range(3):
    r = demo.run_demo(spec, cfg, device=torch.device("cuda"), dtype=torch.bfloat16, repeats=2)
    pq = [x for x in r["results"] if x["method"] == "pq"][0]
    print("run", i, "mass", round(pq["attention_mass"], 3), "recall", round(pq["oracle_recall"], 3), flush=True)
from pqattn.kernels.select import _pq_select_autotuned
print("select configs chosen", {k: str(v) for k, v in _pq_select_autotuned.cache.items()})
keys = torch.randn(2, 8, 8192, 128, device="cuda", dtype=torch.bfloat16)
for M, bits in ((4, 8), (16, 8)):
    b = pqattn.build_index(keys, subvectors=M, bits=bits, iters=2)
    print("build ok", M, bits, b.codes.shape, flush=True)
