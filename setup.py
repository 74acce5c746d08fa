"""Build torchrec-pgas; the CUDA extension ``torchrec_pgas._C`` when nvcc and CUDA torch exist.

``TORCH_PGAS_NO_CUDA=1`` (or no nvcc) gives a pure-Python install whose ``shm``
backend runs on CPU. The extension compiles against the torch of the build
environment, so build with ``pip install --no-build-isolation`` once a stack is
installed (README, "Install and supported stacks").
"""

import glob
import importlib.metadata
import importlib.util
import os
import shutil
from typing import Any, Dict, List, Tuple

from setuptools import find_packages, setup

# The runtime package and its subpackages, and the planner, installed from the top-level planner/.
PACKAGES = find_packages(include=["torchrec_pgas", "torchrec_pgas.*"]) + ["torchrec_pgas.planner"]
PACKAGE_DIR = {"torchrec_pgas.planner": "planner"}


def _nvshmem_root() -> str:
    """The nvidia-nvshmem wheel torch depends on: link the same host library torch loads."""
    if os.environ.get("NVSHMEM_DIR"):
        return os.environ["NVSHMEM_DIR"]
    spec = importlib.util.find_spec("nvidia.nvshmem")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-nvshmem-cu13 is not installed (pip install torch pulls it)")
    return list(spec.submodule_search_locations)[0]


def _nvshmem_requirement(cuda: str) -> List[str]:
    """_C carries NVSHMEM's device library and loads the host library of the same wheel, which must be
    the same release: a wheel of _C requires the nvidia-nvshmem wheel it was built against."""
    if os.environ.get("NVSHMEM_DIR"):
        return []
    name = f"nvidia-nvshmem-cu{cuda.split('.')[0]}"
    return [f"{name}=={importlib.metadata.version(name)}"]


def _build_command(base: Any) -> Any:
    """torch's BuildExtension, linking with no RUNPATH but the extension's own.

    The interpreter's ``LDSHARED`` may carry ``-Wl,-rpath,<its lib dir>`` (pyenv's does), and some setuptools
    releases link C++ with it: the wheel would then search that build machine's directory first for every
    library, NVSHMEM's host library included. ``extra_link_args`` below name the one RUNPATH the wheel needs.
    """

    class BuildWithOwnRunpath(base):  # type: ignore[misc, valid-type]
        def build_extensions(self) -> None:
            for attr in ("linker_so", "linker_so_cxx"):
                if hasattr(self.compiler, attr):
                    argv = getattr(self.compiler, attr)
                    setattr(self.compiler, attr, [a for a in argv if not a.startswith(("-Wl,-rpath,", "-Wl,-rpath="))])
            super().build_extensions()

    return BuildWithOwnRunpath


def _extensions() -> Tuple[List[Any], Dict[str, Any], List[str]]:
    """The extension, its build command and what it adds to the requirements (nothing without nvcc)."""
    if os.environ.get("TORCH_PGAS_NO_CUDA") == "1" or shutil.which("nvcc") is None:
        return [], {}, []
    try:
        import torch
    except ModuleNotFoundError as e:  # pip's isolated build environment has no torch
        raise RuntimeError(
            "building torchrec_pgas._C needs the torch it will run with: install a stack, then "
            "pip install --no-build-isolation (or set TORCH_PGAS_NO_CUDA=1 for the pure-Python package)"
        ) from e
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    if torch.version.cuda is None:
        return [], {}, []
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    root = _nvshmem_root()
    ext = CUDAExtension(
        name="torchrec_pgas._C",
        sources=sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu")),
        include_dirs=[os.path.abspath("csrc"), f"{root}/include"],
        library_dirs=[f"{root}/lib"],
        extra_compile_args={
            # No -std: torch's BuildExtension adds the standard its headers need (C++17 up to
            # torch 2.13, C++20 from 2.14).
            "cxx": ["-O3"],
            # -rdc: NVSHMEM device calls are resolved by the device link below.
            "nvcc": [
                "-O3",
                "-lineinfo",  # source-level ncu profiles; no effect on the code
                "-rdc=true",
                "--expt-relaxed-constexpr",
                # torch defines these to keep half arithmetic out of its own
                # kernels; NVSHMEM's reduction headers need it.
                "-U__CUDA_NO_HALF_OPERATORS__",
                "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_HALF2_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                # nvcc 13 compresses a large fatbinary by default; plain, it loads without an inflate and the
                # build's checks (tests/test_extension.py) can read its architecture and NVSHMEM's device code
                "--no-compress",
            ],
            "nvcc_dlink": ["-dlink", "--no-compress", f"-L{root}/lib", "-lnvshmem_device"],
        },
        extra_link_args=[
            "-lcuda",
            "-l:libnvshmem_host.so.3",
            "-l:libnvshmem_device.a",
            # Installed, _C sits in site-packages/torchrec_pgas/ and the host library in
            # site-packages/nvidia/nvshmem/lib/ (torch's own libraries carry the same relative
            # path). `import torch` loads that library first anyway, which is what serves an
            # in-tree build.
            "-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib",
        ],
    )
    return [ext], {"build_ext": _build_command(BuildExtension)}, _nvshmem_requirement(torch.version.cuda)


ext_modules, cmdclass, ext_requires = _extensions()

setup(
    name="torchrec-pgas",
    version="0.1.0",
    description="TorchRec sharding plugin: NVSHMEM one-sided communication fused into embedding kernels",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    package_data={"torchrec_pgas": ["stacks/*.txt"], "torchrec_pgas.planner": ["profiles/*.json"]},
    # The tested ranges (stacks 1.6 and 1.9). FBGEMM and TorchRec come through an extra, pinned to one
    # stack by its constraints file: pip cannot pair FBGEMM with torch, nor keep TorchRec's unpinned
    # fbgemm-gpu off a CPU install (torchrec_pgas/stack.py checks what it cannot).
    install_requires=["torch>=2.11,<2.15", "numpy>=1.26,<3", "pyyaml>=6,<7", *ext_requires],
    extras_require={
        "gpu": ["torchrec>=1.6.1,<1.10", "fbgemm-gpu>=1.6,<1.10"],
        # TorchRec itself then goes in with --no-deps (its metadata asks for fbgemm-gpu): these are its
        # other requirements, torchmetrics pinned as TorchRec pins it.
        "cpu": ["fbgemm-gpu-cpu>=1.6,<1.10", "tensordict", "torchmetrics==1.0.3", "tqdm", "pyre-extensions",
                "iopath"],
        # torchx 0.7.0 (the last release) pins urllib3<1.27; the nightly installs cleanly.
        "torchx": ["torchx-nightly==2026.10.26"],
        # benchmarks/: progress bars and the PNG figures of a result folder.
        "bench": ["matplotlib", "tqdm"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
)
