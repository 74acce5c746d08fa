"""How eager_host_profile_<pair>.log was measured (not part of the package): where the host time of an eager
training step goes, PGAS (owner_backward="pgas") next to stock, W = 1, s004 configs at each workload's own ids
capacity: p50 of 30 timed steps, then cProfile over 30 steps (our functions and the torch calls they make) and
torch.profiler's host self times. From the repository root:
python -m torch.distributed.run --nproc_per_node=1 <this file> rw|tw"""
import cProfile, io, os, pstats, sys
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import benchmarks.embedding as be
from torchrec_pgas import PgasConfig, shutdown
from torchrec_pgas.layout import StepLayout

torch.cuda.set_device(0)
dist.init_process_group("nccl")
dev = torch.device("cuda", 0)
pair = sys.argv[1] if len(sys.argv) > 1 else "rw"
cases = [(2, 128, 4), (64, 1024, 8)]
heap = sum(StepLayout(world_size=1, num_features=t, max_batch=b, ids_capacity=t * b * p, dim_sum=t * 32,
                      weighted=False).nbytes for t, b, p in cases) + (1 << 30)
os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap)
fused = {"optimizer": be.OPTIMIZERS["rowwise_adagrad"][0], "learning_rate": 0.01}
for t, b, p in cases:
    w = be.Workload("s004", t, 1_000_000, 32, b, p)
    inputs = be.make_inputs(w, t, b, 1, seed=1, device=dev)
    grads = be.upstream_gradients(inputs, t * 32, seed=2)
    cfg = PgasConfig(max_local_batch_size=b, max_ids_per_rank=t * b * p, training=True, owner_backward="pgas")
    for side in ("stock", "pgas"):
        with torch.no_grad():
            dmp = be.shard_ebc(w, side == "pgas", pair, cfg, dev, fused)
        step = lambda: be.train_step(dmp, inputs[0], grads[0])  # noqa: E731
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ms = []
        for _ in range(30):
            ev[0].record(); step(); ev[1].record(); torch.cuda.synchronize(); ms.append(ev[0].elapsed_time(ev[1]))
        ms.sort()
        print(f"\n=== {pair} {side} t{t} b{b} p{p}: eager step p50 {ms[15]:.3f} ms", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            step()
            torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(22)
        st.sort_stats("cumulative").print_stats(45)
        print(out.getvalue().replace(os.getcwd(), "."), flush=True)
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        rows = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
        print("  host self per step:", ", ".join(f"{e.key} {e.self_cpu_time_total / 10:.0f}us x{e.count // 10}"
                                                for e in rows), flush=True)
        del dmp
        torch.cuda.empty_cache()
shutdown()
