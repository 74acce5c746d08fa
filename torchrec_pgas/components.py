"""torchx components: launch torchrec-pgas jobs the way TorchRec jobs are launched.

    torchx run -s local_cwd torchrec_pgas/components.py:dlrm --nproc_per_node 2 -- --sharding pgas --validate

The same AppDef runs on ``local_cwd``, ``slurm`` and ``kubernetes``; it sets
the environment NVSHMEM and NCCL need (NVLink multicast off, the NVSHMEM heap
size) in every process.
"""

from typing import Dict, Optional

import torchx.specs as specs
from torchx.components.dist import ddp

from torchrec_pgas.placement import SHARED_GPU_ENV

PGAS_ENV: Dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def dlrm(
    *script_args: str,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    gpus_per_node: int = 0,
    cpu: int = 2,
    memMB: int = 8192,
    symmetric_size: str = "2G",
    image: str = "ghcr.io/pytorch/torchx:latest",
    shared_gpu: bool = False,
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """The DLRM example (examples/dlrm/run.py) on nnodes x nproc_per_node processes.

    Args:
        script_args: arguments of examples.dlrm.run (after ``--``)
        nnodes: number of nodes
        nproc_per_node: processes per node (one per GPU on GPU nodes)
        gpus_per_node: GPUs requested per node (0: CPU, shm backend)
        cpu: CPUs requested per node
        memMB: host memory requested per node, in MB
        symmetric_size: NVSHMEM_SYMMETRIC_SIZE, the per-GPU symmetric heap
        image: container image (ignored by local_cwd)
        shared_gpu: every process of a node on its first GPU (gloo between them): tests the multi-rank
            path on one GPU, never a performance setup (torchrec_pgas.placement)
        env: extra environment variables
    """
    return ddp(
        *script_args,
        m="examples.dlrm.run",
        name="torchrec_pgas_dlrm",
        image=image,
        cpu=cpu,
        gpu=gpus_per_node,
        memMB=memMB,
        j=f"{nnodes}x{nproc_per_node}",
        env={**PGAS_ENV, "NVSHMEM_SYMMETRIC_SIZE": symmetric_size, SHARED_GPU_ENV: "1" if shared_gpu else "0",
             **(env or {})},
    )
