"""The torch / FBGEMM / TorchRec stack under torchrec_pgas, checked on import.

pip cannot express how they are coupled: each FBGEMM release loads with one torch minor only (with
another, its operators fail to load on an undefined symbol), FBGEMM comes in two flavours that overwrite
each other's files (``fbgemm-gpu``, ``fbgemm-gpu-cpu``), and TorchRec, whose releases pair with FBGEMM's,
requires ``fbgemm-gpu`` unpinned, so a plain ``pip install torchrec`` pulls the newest. A mismatch fails
late and obscurely inside TorchRec; ``check_stack`` raises first, with the installed versions and the pip
commands that install a tested stack from the constraints files shipped in ``stacks/``. It reads package
metadata only, imports nothing, and takes a few milliseconds.
"""

import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import re
from typing import Dict, List, Optional, Tuple

# TorchRec / FBGEMM minor -> the torch minor of that release (FBGEMM's compatibility table).
# 1.6 and 1.9 are tested (a constraints file each); 1.7 and 1.8 are not, but pass the check.
TORCH_OF: Dict[str, str] = {"1.6": "2.11", "1.7": "2.12", "1.8": "2.13", "1.9": "2.14"}
DEFAULT_STACK = "1.6"
STACKS_DIR = pathlib.Path(__file__).resolve().with_name("stacks")
FBGEMM_FLAVOURS = ("fbgemm-gpu", "fbgemm-gpu-cpu")
SKIP_ENV = "TORCHREC_PGAS_SKIP_STACK_CHECK"


class StackError(ImportError):
    """The installed torch, FBGEMM and TorchRec do not form a supported stack."""


@dataclasses.dataclass(frozen=True)
class Installed:
    """Versions from package metadata: None where a package is missing, "?" where its module is there
    without a release's metadata (a nightly or a source build, not compared)."""

    torch: Optional[str]
    fbgemm: Tuple[Tuple[str, str], ...]  # (distribution, version) of each FBGEMM flavour installed
    torchrec: Optional[str]

    @property
    def fbgemm_version(self) -> Optional[str]:
        return self.fbgemm[0][1] if self.fbgemm else None

    def describe(self) -> str:
        fbgemm = ", ".join(f"{dist} {version}" for dist, version in self.fbgemm) or "no fbgemm_gpu"
        return f"torch {self.torch}, {fbgemm}, torchrec {self.torchrec}"


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _or_module(version: Optional[str], module: str) -> Optional[str]:
    if version is not None:
        return version
    return "?" if importlib.util.find_spec(module) is not None else None


def installed() -> Installed:
    """What this environment has, from metadata (nothing is imported)."""
    fbgemm = tuple((dist, v) for dist, v in ((d, _version(d)) for d in FBGEMM_FLAVOURS) if v is not None)
    if not fbgemm and importlib.util.find_spec("fbgemm_gpu") is not None:
        fbgemm = (("fbgemm_gpu", "?"),)
    return Installed(torch=_or_module(_version("torch"), "torch"), fbgemm=fbgemm,
                     torchrec=_or_module(_version("torchrec"), "torchrec"))


def _minor(version: Optional[str]) -> Optional[str]:
    match = re.match(r"(\d+\.\d+)\.", version or "")
    return match.group(1) if match else None


def problems(found: Installed) -> List[str]:
    """Why ``found`` is not a supported stack (empty when it is)."""
    versions = {"torch": found.torch, "FBGEMM": found.fbgemm_version, "TorchRec": found.torchrec}
    out = [f"{name} is not installed" for name, version in versions.items() if version is None]
    if len(found.fbgemm) > 1:
        out.append("both FBGEMM flavours are installed, and they overwrite each other's files")
    torch_minor = _minor(found.torch)
    for name in ("FBGEMM", "TorchRec"):
        minor = _minor(versions[name])
        if minor is None:
            continue
        if minor not in TORCH_OF:
            out.append(f"{name} {versions[name]} is not supported (TorchRec and FBGEMM {', '.join(TORCH_OF)})")
        elif torch_minor is not None and torch_minor != TORCH_OF[minor]:
            out.append(f"{name} {versions[name]} needs torch {TORCH_OF[minor]}, not {found.torch}")
    fbgemm, torchrec = _minor(versions["FBGEMM"]), _minor(versions["TorchRec"])
    if fbgemm and torchrec and fbgemm != torchrec:
        out.append(f"TorchRec {found.torchrec} needs FBGEMM {torchrec}, not {versions['FBGEMM']}")
    return out


def constraints_file(stack: str) -> pathlib.Path:
    """The shipped constraints file of a tested stack ("1.6", "1.9")."""
    return STACKS_DIR / f"torchrec-{stack}.txt"


def tested_stacks() -> List[str]:
    """The stacks with a constraints file, by their TorchRec minor."""
    return sorted(p.stem.split("-", 1)[1] for p in STACKS_DIR.glob("torchrec-*.txt"))


def fix_commands(found: Installed) -> List[str]:
    """pip commands that install a tested stack: the one of the installed torch if there is one, else the
    default. FBGEMM goes first, both flavours, so that no file of the other one is left behind."""
    by_torch = {TORCH_OF[stack]: stack for stack in tested_stacks()}
    c = constraints_file(by_torch.get(_minor(found.torch) or "", DEFAULT_STACK))
    clean = "pip uninstall -y fbgemm-gpu fbgemm-gpu-cpu"
    return [f'GPU: {clean} && pip install "torchrec-pgas[gpu]" -c {c}',
            f'CPU: {clean} && pip install "torchrec-pgas[cpu]" -c {c} && pip install --no-deps torchrec -c {c}']


def check_stack(found: Optional[Installed] = None) -> None:
    """Raise ``StackError`` naming the installed versions and the fix, unless they form a supported stack.

    Raises rather than warns: a mismatched FBGEMM does not load, or loads without the operators TorchRec
    calls, so nothing after this import would work. ``TORCHREC_PGAS_SKIP_STACK_CHECK=1`` skips the check
    (a deliberate experiment with another stack).
    """
    if os.environ.get(SKIP_ENV) == "1":
        return
    found = found or installed()
    reasons = problems(found)
    if reasons:
        raise StackError("\n  ".join(
            ["torchrec_pgas needs a supported torch / FBGEMM / TorchRec stack", f"installed: {found.describe()}",
             *(f"- {r}" for r in reasons), 'install a tested one (README, "Install and supported stacks"):',
             *fix_commands(found), f"({SKIP_ENV}=1 skips this check)"]))
