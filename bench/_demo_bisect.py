import sys, time, functools, torch
import pqattn.reference.pq as ref_pq
import pqattn.kernels.kmeans as km
from pqattn.index import PQConfig
from pqattn.lab import demo
from pqattn.lab.workload import WorkloadSpec
spec = WorkloadSpec()
cfg = PQConfig(subvectors=2, bits=6, sink=128, window=128, heavy=256, iters=10)
orig_step = km.kmeans_step
for variant in ("tf32", "tf32x3", "ieee", "reference"):
    if variant == "reference":
        km.lloyd = ref_pq.lloyd  # ops._build imports the name at call time
    else:
        km.kmeans_step = functools.partial(orig_step, precision=variant)
    r = demo.run_demo(spec, cfg, device=torch.device("cuda"), dtype=torch.bfloat16, repeats=3)
    pq = [x for x in r["results"] if x["method"] == "pq"][0]
    print(variant, "build_ms", round(r["build_ms"], 1), "mass", round(pq["attention_mass"], 3), "recall", round(pq["oracle_recall"], 3), "err", round(pq["output_rel_err"], 3), flush=True)
