"""How replay_kernels_{rw,tw}.log were measured (not part of the package): the kernels of one PGAS training step
replayed as one CUDA graph (CapturedTrainStep, W = 1), by torch.profiler over 5 replays, for s004 configs at the
workload's own ids capacity and at the sweep's shared one. From the repository root:
python -m torch.distributed.run --nproc_per_node=1 <this file> rw|tw"""
import os, sys, collections
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import benchmarks.embedding as be
from torchrec_pgas import CapturedTrainStep, PgasConfig, shutdown
from torchrec_pgas.layout import StepLayout

torch.cuda.set_device(0)
dist.init_process_group("nccl")
dev = torch.device("cuda", 0)
pair = sys.argv[1] if len(sys.argv) > 1 else "rw"
cases = [(2, 128, 4, 131072), (2, 128, 4, 1024), (16, 1024, 8, 16 * 4096 * 16), (16, 1024, 8, 16 * 1024 * 8),
         (64, 128, 4, 64 * 4096 * 16), (64, 128, 4, 64 * 128 * 4), (64, 4096, 16, 64 * 4096 * 16)]
heap = sum(StepLayout(world_size=1, num_features=t, max_batch=b, ids_capacity=c, dim_sum=t * 32, weighted=False).nbytes
           for t, b, p, c in cases) + (1 << 30)
os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
fused = {"optimizer": be.OPTIMIZERS["rowwise_adagrad"][0], "learning_rate": 0.01}
for t, b, p, cap in cases:
    w = be.Workload("s004", t, 1_000_000, 32, b, p)
    inputs = be.make_inputs(w, t, b, 1, seed=1, device=dev)
    grads = be.upstream_gradients(inputs, t * 32, seed=2)
    cfg = PgasConfig(max_local_batch_size=b, max_ids_per_rank=cap, training=True, owner_backward="pgas")
    with torch.no_grad():
        pgas = be.shard_ebc(w, True, pair, cfg, dev, fused)
    step = CapturedTrainStep(lambda: be.train_step(pgas, inputs[0], grads[0]), warmup_steps=1)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ms = []
    for _ in range(20):
        ev[0].record(); step(); ev[1].record(); torch.cuda.synchronize(); ms.append(ev[0].elapsed_time(ev[1]))
    ms.sort()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kern = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kern[e.name[:90]]; k[0] += 1; k[1] += e.device_time
    n = sum(v[0] for v in kern.values()) / 5; tot = sum(v[1] for v in kern.values()) / 5
    print(f"\n=== {pair} t{t} b{b} p{p} capacity {cap}: replay p50 {ms[10]:.3f} ms, {n:.0f} kernels/replay, "
          f"kernel time {tot/1e3:.3f} ms", flush=True)
    for name, (c, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {us/5:9.1f} us  x{c/5:4.0f}  {name}")
    cpu = collections.defaultdict(float)
    for e in prof.key_averages():
        cpu[e.key] = e.self_cpu_time_total / 5
    print("  host (self, per replay):", ", ".join(f"{k} {v:.0f}us" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])[:8]))
    del step, pgas
    torch.cuda.empty_cache()
shutdown()
