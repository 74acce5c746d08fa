"""Stress the exit of two-process CPU jobs (gloo + shm runtime + DMP): issue 43's rank that dies at exit.

Runs ``--runs`` short two-rank jobs one after the other, under ``--load`` busy-loop processes, with one rank
(picked at random) sleeping a random few ms before it exits, and counts the runs that end badly: a nonzero
exit code, a signal (SIGABRT: "terminate called without an active exception") or "terminate called" in a
rank's stderr. The ranks find each other as under ``torchrun`` (``env://`` with the store served by this
process, ``TORCHELASTIC_USE_AGENT_STORE``).

``--launch fork`` (the default; ~2 s a run unloaded against ~3.5 s for spawn) forks the ranks from this
process after it imported torch, TorchRec and torchrec-pgas once: each rank still runs its job and then the
interpreter's whole exit (atexit hooks, finalization). ``spawn`` starts fresh interpreters, like ``torchrun``, ``mp`` runs them under
``run_distributed`` (the test launcher, which calls ``shutdown()``); ``--gdb`` (spawn) runs them
under gdb and keeps its backtrace of every thread for the runs that fail.

    .venv/bin/python scripts/teardown_stress.py --runs 300 --exit destroy
    .venv/bin/python scripts/teardown_stress.py --runs 20 --launch spawn --gdb --keep /tmp/aborts

The last line: ``runs N  bad B  rate R%  (aborts A, nonzero X, 'terminate called' T)  per run S s``.
"""

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

WORLD = 2
JOBS = ("train", "init")
EXITS = ("none", "destroy", "shutdown")
PIN_ENV = "TEARDOWN_STRESS_PIN"


# ---- the job of one rank ----------------------------------------------------------------------------------


def _train_step(rank: int) -> None:
    """The smallest PGAS training job: one 2-table EBC, row-wise and table-wise, one forward + backward, a report."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from torchrec_pgas import PgasEmbeddingBagCollectionSharder
    from torchrec_pgas.planner import pgas_row_wise, pgas_table_wise

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="a", num_embeddings=16, embedding_dim=4, feature_names=["fa"]),
                EmbeddingBagConfig(name="b", num_embeddings=8, embedding_dim=4, feature_names=["fb"])],
        device=torch.device("meta"),
    )
    sharder = PgasEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    plan = construct_module_sharding_plan(ebc, {"a": pgas_row_wise(), "b": pgas_table_wise(1)}, sharder=sharder,
                                          local_size=WORLD, world_size=WORLD, device_type="cpu")
    model = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                     device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["fa", "fb"], values=torch.tensor([rank, 3, 5, 1, 7, 2]),
                                              lengths=torch.tensor([2, 1, 1, 2]))
    out = model(kjt)
    loss = out.values().sum()
    loss.backward()
    model.fused_optimizer.step()
    losses: List[object] = [None] * WORLD
    dist.all_gather_object(losses, float(loss))  # a last collective, as a script's report of its result


def _rank_main(rank: int, job: str, exit_how: str, sleep_s: float) -> None:
    """One rank: init as under torchrun, the job, the exit a user's script would take."""
    import torch
    import torch.distributed as dist

    import torchrec_pgas

    if os.environ.get(PIN_ENV):
        os.sched_setaffinity(0, {int(os.environ[PIN_ENV])})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torchrec_pgas.init()
    if job == "train":
        _train_step(rank)
    if exit_how == "destroy":
        dist.destroy_process_group()
    elif exit_how == "shutdown":
        torchrec_pgas.shutdown()
    time.sleep(sleep_s)


def _mp_job(rank: int, world: int, job: str, exit_how: str, sleeps: List[float]) -> int:
    """``--launch mp``: a rank under ``run_distributed``, which inits and then calls ``shutdown()`` itself."""
    import torch.distributed as dist

    import torchrec_pgas

    if os.environ.get(PIN_ENV):
        os.sched_setaffinity(0, {int(os.environ[PIN_ENV])})
    torchrec_pgas.init()
    if job == "train":
        _train_step(rank)
    if exit_how == "destroy":
        dist.destroy_process_group()  # then run_distributed's shutdown() finds no group
    time.sleep(sleeps[rank])
    return rank


def _rank_env(rank: int, port: int) -> dict:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


# ---- launching and judging a run ------------------------------------------------------------------------


@dataclass
class Rank:
    err_path: str
    status: int = 0  # os.waitstatus_to_exitcode: < 0 is a signal


def _zygote() -> Tuple[int, int, float, str]:
    """Fork mode's rank factory: reads ``port sleep0 sleep1 rundir`` lines, forks both ranks, answers with their
    exit statuses. Returns only in a forked rank, with what it runs: no frame of this loop has cleanup to run
    at that rank's exit, which is the interpreter's normal one (atexit hooks, then finalization)."""
    for line in sys.stdin:
        port, s0, s1, rundir = line.split()
        pids = []
        for rank, sleep_s in enumerate((float(s0), float(s1))):
            pid = os.fork()
            if pid == 0:
                return rank, int(port), sleep_s, rundir
            pids.append(pid)
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(*statuses, flush=True)
    raise SystemExit(0)


def _forked_rank(rank: int, port: int, sleep_s: float, rundir: str, args: argparse.Namespace) -> None:
    os.chdir(rundir)  # a core dump lands here
    fd = os.open(f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.update(_rank_env(rank, port))
    _rank_main(rank, args.job, args.exit, sleep_s)


def _spawn_rank(rank: int, rundir: str, port: int, args: argparse.Namespace, sleep_s: float) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--job", args.job, "--exit", args.exit,
           "--sleep", str(sleep_s)]
    if args.gdb:
        cmd = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "handle SIGPIPE nostop noprint", "-ex",
               "run", "-ex", "thread apply all bt", "--args"] + cmd
    with open(os.path.join(rundir, f"rank{rank}.err"), "w") as err:
        return subprocess.Popen(cmd, cwd=rundir, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **_rank_env(rank, port)})


def _one_run(rundir: str, args: argparse.Namespace, rng: random.Random, zygote: Optional[subprocess.Popen]
             ) -> List[Rank]:
    """Both ranks of one job; the one picked sleeps up to ``--max-sleep-ms`` before its exit."""
    import torch.distributed as dist

    sleeper = rng.randrange(WORLD)
    sleeps = [rng.uniform(0, args.max_sleep_ms) / 1e3 if r == sleeper else 0.0 for r in range(WORLD)]
    ranks = [Rank(os.path.join(rundir, f"rank{r}.err")) for r in range(WORLD)]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if args.launch == "mp":
        del store
        return _mp_run(ranks, args, sleeps)
    if zygote is not None:
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdin.write(f"{store.port} {sleeps[0]} {sleeps[1]} {rundir}\n")
        zygote.stdin.flush()
        for rk, status in zip(ranks, zygote.stdout.readline().split()):
            rk.status = int(status)
    else:
        procs = [_spawn_rank(r, rundir, store.port, args, sleeps[r]) for r in range(WORLD)]
        for rk, proc in zip(ranks, procs):
            rk.status = proc.wait()
    return ranks


def _mp_run(ranks: List[Rank], args: argparse.Namespace, sleeps: List[float]) -> List[Rank]:
    """Both ranks under ``run_distributed`` (the test launcher), their stderr (ours, redirected) in rank0.err."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from torchrec_pgas.testing import run_distributed

    saved = os.dup(2)
    fd = os.open(ranks[0].err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    open(ranks[1].err_path, "w").close()
    try:
        run_distributed(_mp_job, WORLD, args.job, args.exit, sleeps)
    except (ProcessExitedException, ProcessRaisedException) as e:
        # negative: the signal
        ranks[e.error_index].status = e.exit_code if isinstance(e, ProcessExitedException) else 1
        with open(ranks[e.error_index].err_path, "a") as err:
            err.write(f"run_distributed: {e}\n")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return ranks


def _verdict(ranks: List[Rank], gdb: bool) -> Optional[str]:
    """Why the run is bad ("abort": a signal; "terminate": the message; "nonzero"), None when it is good."""
    texts = [open(rk.err_path, errors="replace").read() for rk in ranks]
    if any(rk.status < 0 for rk in ranks) or (gdb and any("received signal SIGABRT" in t for t in texts)):
        return "abort"
    if any("terminate called" in t for t in texts):
        return "terminate"
    if any(rk.status != 0 for rk in ranks) or (gdb and any("exited with code" in t for t in texts)):
        return "nonzero"
    return None


def _busy_loops(n: int, pin: int) -> List[subprocess.Popen]:
    cmd = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(cmd if pin < 0 else ["taskset", "-c", str(pin)] + cmd) for _ in range(n)]


def _start_zygote(args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--zygote", "--job", args.job, "--exit", args.exit]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _stress(args: argparse.Namespace) -> None:
    """The runs, the counts and the final line."""
    rng = random.Random(args.seed)
    counts = {"abort": 0, "terminate": 0, "nonzero": 0}
    if args.pin >= 0:
        os.environ[PIN_ENV] = str(args.pin)  # the ranks read it (a fork inherits the zygote's copy)
    helpers = _busy_loops(args.load, args.pin)
    zygote = _start_zygote(args) if args.launch == "fork" else None
    t0 = time.monotonic()
    try:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="teardown-") as rundir:
                ranks = _one_run(rundir, args, rng, zygote)
                why = _verdict(ranks, args.gdb)
                if why:
                    counts[why] += 1
                    print(f"run {i}: {why}: exit statuses {[rk.status for rk in ranks]}", flush=True)
                    if args.keep:
                        shutil.copytree(rundir, os.path.join(args.keep, f"run{i:05d}"))
            if (i + 1) % 50 == 0:
                print(f"... {i + 1} runs, {sum(counts.values())} bad, {(time.monotonic() - t0) / (i + 1):.2f} s/run",
                      flush=True)
    finally:
        for proc in helpers + ([zygote] if zygote else []):
            proc.kill()
            proc.wait()
    bad = sum(counts.values())
    print(f"runs {args.runs}  bad {bad}  rate {100.0 * bad / max(1, args.runs):.2f}%  (aborts {counts['abort']}, "
          f"nonzero {counts['nonzero']}, 'terminate called' {counts['terminate']})  "
          f"per run {(time.monotonic() - t0) / max(1, args.runs):.2f} s  "
          f"[job {args.job}, exit {args.exit}, launch {args.launch}, load {args.load}, pin {args.pin}]", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--job", choices=JOBS, default="train",
                   help="train: gloo + shm runtime + a PGAS-sharded EBC's forward and training step; init: no model")
    p.add_argument("--exit", choices=EXITS, default="destroy",
                   help="after the job: nothing, dist.destroy_process_group(), or torchrec_pgas.shutdown()")
    p.add_argument("--launch", choices=("fork", "spawn", "mp"), default="fork")
    p.add_argument("--load", type=int, default=2, help="busy-loop processes running alongside")
    p.add_argument("--pin", type=int, default=-1,
                   help="run the ranks and the busy loops on this one CPU (-1: anywhere): more preemption")
    p.add_argument("--max-sleep-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gdb", action="store_true", help="spawn: run the ranks under gdb (backtraces of failures)")
    p.add_argument("--keep", default="", help="a folder to keep the failed runs' stderr (and core files) in")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gdb and args.launch != "spawn":
        p.error("--gdb needs --launch spawn")
    if args.rank >= 0:
        _rank_main(args.rank, args.job, args.exit, args.sleep)
    elif args.zygote:
        _warm_imports(args.job)
        _forked_rank(*_zygote(), args)
    else:
        _stress(args)


def _warm_imports(job: str) -> None:
    """Import what a rank imports, once, before the zygote forks it."""
    import torch.distributed  # noqa: F401

    import torchrec_pgas  # noqa: F401
    if job == "train":
        import fbgemm_gpu.split_embedding_configs  # noqa: F401
        import torchrec.distributed.model_parallel  # noqa: F401

        import torchrec_pgas.planner  # noqa: F401


if __name__ == "__main__":
    main()
