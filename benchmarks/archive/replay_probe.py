"""Probe (not part of the repo): where an eager training step's graph replays spend host time. W = 1,
RW and TW, t2 b128 p8 and t64 b4096 p16: torch.profiler over 10 steps (CPU ops + CUDA runtime calls + kernels
a step), then each kept graph replayed alone, host us a replay. From the tree's root:
python -m torch.distributed.run --nproc_per_node=1 .devbundle/replay_probe.py"""
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import benchmarks.embedding as be
from torchrec_pgas import PgasConfig, shutdown
from torchrec_pgas.embeddingbag import pgas_steps
from torchrec_pgas.layout import StepLayout
from torch.profiler import profile, ProfilerActivity

torch.cuda.set_device(0)
dist.init_process_group("nccl")
dev = torch.device("cuda", 0)
cases = [(2, 128, 8), (64, 4096, 16)]
heap = 2 * sum(StepLayout(world_size=1, num_features=t, max_batch=b, ids_capacity=t * b * p, dim_sum=t * 32,
                          weighted=False).nbytes for t, b, p in cases) + (1 << 30)
os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
fused = {"optimizer": be.OPTIMIZERS["rowwise_adagrad"][0], "learning_rate": 0.01}
g = torch.cuda.CUDAGraph()
x = torch.zeros(1, device=dev)
with torch.cuda.graph(g):
    x.add_(1)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(100):
    g.replay()
print(f"trivial graph: {1e6 * (time.perf_counter() - t0) / 100:.1f} us a replay")
for pair in ("rw", "tw"):
    for t, b, p in cases:
        w = be.Workload("s004", t, 1_000_000, 32, b, p)
        inputs = be.make_inputs(w, t, b, 1, seed=1, device=dev)
        grads = be.upstream_gradients(inputs, t * 32, seed=2)
        cfg = PgasConfig(max_local_batch_size=b, max_ids_per_rank=t * b * p, training=True, owner_backward="pgas")
        with torch.no_grad():
            dmp = be.shard_ebc(w, True, pair, cfg, dev, fused)
        step = lambda: be.train_step(dmp, inputs[0], grads[0])  # noqa: E731
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        rows = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
        print(f"\n=== {pair} t{t} b{b} p{p}: host self us a step (count a step)")
        print("  " + "\n  ".join(f"{e.key[:70]:70s} {e.self_cpu_time_total / 10:8.1f} x{e.count / 10:.1f}" for e in rows))
        kernels = [e for e in tp.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"  GPU kernels/copies a step: {sum(e.count for e in kernels) / 10:.1f}; "
              + ", ".join(f"{e.key[:40]} x{e.count / 10:.1f}" for e in sorted(kernels, key=lambda e: -e.count)[:12]))
        for s in pgas_steps(dmp):
            for key, bg in getattr(s, "_backward_graphs", {}).items():
                for name in ("exchange", "update", "graph"):
                    gr = getattr(bg, name, None)
                    if gr is None:
                        continue
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    gr.replay()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    print(f"  graph {key} {name}: replay call {1e6 * (t1 - t0):.1f} us, to done {1e6 * (t2 - t0):.1f} us")
        del dmp
        torch.cuda.empty_cache()
shutdown()
