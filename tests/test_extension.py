"""The CUDA extension: built for sm_90a with its kernels, ops registered with meta impls.

These run without a GPU: `make test` builds the extension wherever nvcc exists,
so CI proves it compiles; loading it needs no device.
"""

import pathlib
import re
import subprocess

import pytest
import torch

from torchrec_pgas.layout import StepLayout
from torchrec_pgas.step_abi import BoundsMode, KeptBagsConfig, OwnerKeysConfig, as_tensor, build

pytestmark = pytest.mark.stacks

try:
    import torchrec_pgas._C as _C
except ImportError:  # pure-Python install (TORCH_PGAS_NO_CUDA=1 or no nvcc)
    _C = None

needs_ext = pytest.mark.skipif(_C is None, reason="torchrec_pgas._C not built (no nvcc)")


@needs_ext
def test_built_for_hopper_with_device_link() -> None:
    blob = pathlib.Path(_C.__file__).read_bytes()
    assert b"-arch sm_90a" in blob  # TORCH_CUDA_ARCH_LIST=9.0a, device-linked
    assert b"nvshmem_device" in blob  # NVSHMEM device library linked in (-rdc + dlink)
    for kernel in (b"put_kernel", b"signal_kernel", b"wait_kernel", b"index_dist_kernel", b"pooled_lookup_kernel",
                   b"combine_partials_kernel", b"owner_walk_kernel", b"owner_finish_kernel",
                   b"owner_keys_kernel"):
        assert kernel in blob


@needs_ext
def test_ops_registered() -> None:
    ops = torch.ops.torchrec_pgas
    expected = {
        "alloc": "torchrec_pgas::alloc(int nbytes) -> Tensor",
        "put": "torchrec_pgas::put(Tensor(a!) dst, Tensor src, int peer) -> ()",
        "signal": "torchrec_pgas::signal(Tensor(a!) word, int value, int peer) -> ()",
        "wait": "torchrec_pgas::wait(Tensor pad, Tensor slots, int epoch, int timeout_ns, Tensor(a!) status) -> ()",
        "init": "torchrec_pgas::init(Tensor uid, int rank, int world_size) -> ()",
        "step_abi": "torchrec_pgas::step_abi() -> Tensor",
    }
    for name, schema in expected.items():
        assert str(getattr(ops, name).default._schema) == schema


@needs_ext
def test_dispatch_keys_and_meta_impl() -> None:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("put", "signal", "wait", "free", "index_dist", "pooled_lookup", "combine_partials", "owner_update",
               "kept_bags", "owner_keys", "sort_owner_keys"):
        assert has(f"torchrec_pgas::{op}", "CUDA"), op
    for op in ("owner_update", "kept_bags", "owner_keys", "sort_owner_keys"):  # the CPU path of the same algorithm
        assert has(f"torchrec_pgas::{op}", "CPU"), op
    assert has("torchrec_pgas::alloc", "Meta")
    meta = torch.ops.torchrec_pgas.alloc.default.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.Meta), 1024
    )
    assert meta.shape == (1024,) and meta.dtype == torch.uint8 and meta.device.type == "meta"


@needs_ext
def test_combine_partials_meta_impl() -> None:
    """Fake/meta tracing of the step (torch.compile, FX) goes through this impl: [batch, 4 x column vectors]."""
    meta = torch.device("meta")
    t = torch.empty(8, dtype=torch.int64, device=meta)
    lay = StepLayout(world_size=2, num_features=3, max_batch=16, ids_capacity=64, dim_sum=24, weighted=False,
                     id_bytes=4)
    config = as_tensor(lay.config(timeout_ns=10**9, rank=0, bounds_mode=BoundsMode.FATAL))
    col_feature = torch.empty(6, dtype=torch.int32, device=meta)
    out = torch.ops.torchrec_pgas.combine_partials(torch.empty(lay.nbytes, dtype=torch.uint8, device=meta),
                                                  t, t, t, t, t, t, config, col_feature, 5, torch.bfloat16)
    assert out.shape == (5, 24) and out.dtype == torch.bfloat16 and out.device.type == "meta"


@needs_ext
def test_owner_keys_meta_impls() -> None:
    """The captured owner backward's ops under fake/meta tracing: the capacity's keys (the key dtype), bags
    and weights, and the sort's outputs shaped as its inputs."""
    meta = torch.device("meta")
    i64 = torch.empty(9, dtype=torch.int64, device=meta)
    config = as_tensor(build(OwnerKeysConfig, first_bag=0, end_bag=8, stride=4, key_limit=100))
    keys, bags, psw = torch.ops.torchrec_pgas.owner_keys(
        torch.empty(64, dtype=torch.int32, device=meta), None, i64, None, i64,
        torch.empty(2, dtype=torch.int32, device=meta), config, 40)
    assert (keys.shape, keys.dtype, bags.shape, bags.dtype, psw.shape) == ((40,), torch.int32, (40,), torch.int32, (0,))
    out = torch.ops.torchrec_pgas.sort_owner_keys(keys, bags, torch.empty(40, device=meta), 100)
    assert [t.shape for t in out] == [(40,)] * 3 and all(t.device.type == "meta" for t in out)


@needs_ext
def test_kept_bags_meta_impl() -> None:
    """The kept bags on meta tensors: a bag per held feature, source and row; no weights' starts unweighted
    (sizes from the op's num_bags and weighted: the config is not read, as a fake tensor's cannot be)."""
    meta = torch.device("meta")
    config = build(KeptBagsConfig, index_block_bytes=4096, lengths_off=64, offsets_off=256, ids_off=512,
                   weights_off=-1, id_bytes=4, max_batch=8, features_per_block=5, first_feature=1,
                   num_features=3, world=2, rows=6)
    lengths, first_id, first_weight = torch.ops.torchrec_pgas.kept_bags(
        torch.empty(8192, dtype=torch.uint8, device=meta), torch.empty(1, dtype=torch.int64, device=meta),
        torch.empty(2, dtype=torch.int64, device=meta), None, as_tensor(config), 36, False)
    assert (lengths.shape, first_id.shape, first_weight.shape) == ((36,), (36,), (0,))
    assert lengths.dtype == first_id.dtype == torch.int64 and lengths.device.type == "meta"


@needs_ext
def test_nvshmem_is_found_beside_the_package_not_in_the_build_environment() -> None:
    """Installed, $ORIGIN/../nvidia/nvshmem/lib is site-packages/nvidia/nvshmem/lib (tests/test_install.py
    resolves it from a wheel); in place, torch has loaded that library already and _C shares it."""
    dynamic = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True, check=True).stdout
    assert re.findall(r"R(?:UN)?PATH.*\[(.*)\]", dynamic) == ["$ORIGIN/../nvidia/nvshmem/lib"], dynamic
    loaded = {line.split()[-1] for line in open("/proc/self/maps") if "libnvshmem_host" in line}
    assert len(loaded) == 1, loaded


CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
TENSOR_HEADERS = re.compile(r'#include\s*<(ATen/|torch/|c10/cuda/)')


def _includes(path: pathlib.Path) -> set[pathlib.Path]:
    """`path` and the csrc headers it includes, transitively."""
    seen: set[pathlib.Path] = set()
    todo = [path]
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        names = re.findall(r'#include\s*"([^"]+)"', file.read_text())
        todo += [CSRC / name for name in names if (CSRC / name).exists()]
    return seen


def test_kernel_files_include_no_tensor_header() -> None:
    """A .cu file sees raw pointers and a stream, never a tensor: the ops' host side (step_ops.cpp, runtime.cpp,
    *_host.cpp) checks the tensors and calls its launches. ATen's tensor headers cost nvcc ~10 s a file of a
    2-core build (g++ ~3 s), three builds a CI run."""
    kernels = sorted(CSRC.glob("*.cu"))
    assert len(kernels) >= 7
    offending = {f"{cu.name} <- {header.name}" for cu in kernels for header in _includes(cu)
                 if TENSOR_HEADERS.search(header.read_text())}
    assert not offending, offending
