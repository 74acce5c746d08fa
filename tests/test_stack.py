"""The import-time stack check on faked versions, and the shipped constraints files against the package's
metadata (setup.py) and the check's table."""

import importlib.metadata
import pathlib
import re
import subprocess
import sys
import sysconfig
from typing import Dict, List, Optional

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from torchrec_pgas import stack
from torchrec_pgas.stack import Installed, StackError

pytestmark = pytest.mark.stacks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _installed(torch: Optional[str], torchrec: Optional[str], **fbgemm: str) -> Installed:
    """fbgemm: flavour=version, the flavour's dashes as underscores (fbgemm_gpu_cpu="1.9.0")."""
    return Installed(torch=torch, torchrec=torchrec,
                     fbgemm=tuple((dist.replace("_", "-"), v) for dist, v in fbgemm.items()))


@pytest.mark.parametrize("found", [
    _installed("2.11.0+cu130", "1.6.1", fbgemm_gpu="1.6.0"),  # the GPU machine's devbundle
    _installed("2.11.0", "1.6.1", fbgemm_gpu_cpu="1.6.0"),
    _installed("2.14.1", "1.9.2", fbgemm_gpu_cpu="1.9.0"),
    _installed("2.12.0", "1.7.0", fbgemm_gpu="1.7.0"),  # untested, but a consistent stack
    _installed("2.11.0", "?", fbgemm_gpu="1.6.0"),  # a TorchRec nightly or source build: not compared
    _installed("2.11.0", "1.6.1", fbgemm_gpu="?"),
])
def test_supported_stacks_pass(found: Installed) -> None:
    assert stack.problems(found) == []
    stack.check_stack(found)


@pytest.mark.parametrize("found, reasons, fix_stack", [
    # FBGEMM 1.9.0 does not load with torch 2.15 (undefined c10::report_overflow); no tested stack has 2.15
    (_installed("2.15.0", "1.9.2", fbgemm_gpu="1.9.0"), ["FBGEMM 1.9.0 needs torch 2.14, not 2.15.0",
                                                         "TorchRec 1.9.2 needs torch 2.14, not 2.15.0"], "1.6"),
    # `pip install torchrec==1.6.1` with its dependencies: the newest fbgemm-gpu
    (_installed("2.11.0", "1.6.1", fbgemm_gpu="1.9.0"), ["FBGEMM 1.9.0 needs torch 2.14, not 2.11.0",
                                                         "TorchRec 1.6.1 needs FBGEMM 1.6, not 1.9.0"], "1.6"),
    (_installed("2.14.1", "1.9.2", fbgemm_gpu="1.9.0", fbgemm_gpu_cpu="1.9.0"),
     ["both FBGEMM flavours are installed, and they overwrite each other's files"], "1.9"),
    (_installed("2.14.1", None, fbgemm_gpu_cpu="1.9.0"), ["TorchRec is not installed"], "1.9"),
    (_installed("2.14.1", "1.9.2"), ["FBGEMM is not installed"], "1.9"),
    (_installed("2.10.0", "1.5.0", fbgemm_gpu="1.5.0"), ["FBGEMM 1.5.0 is not supported (TorchRec and FBGEMM "
                                                         "1.6, 1.7, 1.8, 1.9)",
                                                         "TorchRec 1.5.0 is not supported (TorchRec and FBGEMM "
                                                         "1.6, 1.7, 1.8, 1.9)"], "1.6"),
])
def test_mismatch_raises_with_versions_and_fix(found: Installed, reasons: List[str], fix_stack: str) -> None:
    assert stack.problems(found) == reasons
    with pytest.raises(ImportError) as err:
        stack.check_stack(found)
    assert isinstance(err.value, StackError)
    message = str(err.value)
    assert f"installed: {found.describe()}" in message and all(f"- {r}" in message for r in reasons)
    constraints = stack.constraints_file(fix_stack)
    assert constraints.is_file()
    # the installed torch's stack where one is tested, else the default
    assert f'GPU: pip uninstall -y fbgemm-gpu fbgemm-gpu-cpu && pip install "torchrec-pgas[gpu]" -c {constraints}' \
        in message
    assert (f'CPU: pip uninstall -y fbgemm-gpu fbgemm-gpu-cpu && pip install "torchrec-pgas[cpu]" -c {constraints}'
            f" && pip install --no-deps torchrec -c {constraints}") in message


def test_skip_env_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    found = _installed("2.15.0", "1.9.2", fbgemm_gpu="1.9.0")
    monkeypatch.setenv(stack.SKIP_ENV, "1")
    stack.check_stack(found)
    monkeypatch.setenv(stack.SKIP_ENV, "0")
    with pytest.raises(StackError):
        stack.check_stack(found)


def test_reads_metadata_without_importing() -> None:
    """The check runs before torchrec loads FBGEMM, so it must not import what it checks; it is cheap."""
    code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('stack', {str(ROOT / 'torchrec_pgas' / 'stack.py')!r})\n"
        "s = importlib.util.module_from_spec(spec); spec.loader.exec_module(s)\n"
        "t = time.perf_counter(); s.check_stack(); ms = (time.perf_counter() - t) * 1e3\n"
        "print(s.installed().describe(), sorted(m for m in ('torch', 'fbgemm_gpu', 'torchrec') if m in sys.modules), ms)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[:-1] == stack.installed().describe().split() + ["[]"]
    assert float(out[-1]) < 200  # milliseconds; about 4 here


def _pins(stack_name: str) -> Dict[str, str]:
    lines = stack.constraints_file(stack_name).read_text().splitlines()
    pins = [line for line in lines if line.strip() and not line.startswith("#")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", line) for line in pins), pins
    return dict(line.split("==") for line in pins)  # type: ignore[misc]


def _requires() -> Dict[str, Requirement]:
    """The installed package's requirements, "extra:name" for those of an extra (from site-packages: an
    in-tree build leaves a torchrec_pgas.egg-info of its own in the checkout)."""
    site = [sysconfig.get_paths()["purelib"]]
    out = {}
    for text in next(importlib.metadata.distributions(name="torchrec-pgas", path=site)).requires or []:
        req = Requirement(text)
        extra = re.search(r'extra == "(\w+)"', str(req.marker)) if req.marker else None
        out[f"{extra.group(1)}:{req.name}" if extra else req.name] = req
    return out


def test_tested_stacks_are_the_readme_two() -> None:
    assert stack.tested_stacks() == ["1.6", "1.9"] and stack.DEFAULT_STACK == "1.6"
    makefile, script = (ROOT / "Makefile").read_text(), (ROOT / "scripts" / "install_deps.sh").read_text()
    assert f"STACK ?= {stack.DEFAULT_STACK}\n" in makefile and f"STACK=${{2:-{stack.DEFAULT_STACK}}}\n" in script


@pytest.mark.parametrize("name", ["1.6", "1.9"])
def test_constraints_form_a_stack_within_the_metadata(name: str) -> None:
    pins, req = _pins(name), _requires()
    assert Version(pins["torchrec"]).release[:2] == tuple(int(x) for x in name.split("."))
    for flavour in stack.FBGEMM_FLAVOURS:
        assert stack.problems(Installed(pins["torch"], ((flavour, pins[flavour]),), pins["torchrec"])) == []
    for key, pin in [("torch", "torch"), ("gpu:fbgemm-gpu", "fbgemm-gpu"), ("cpu:fbgemm-gpu-cpu", "fbgemm-gpu-cpu"),
                     ("gpu:torchrec", "torchrec"), ("cpu:torchmetrics", "torchmetrics")]:
        assert req[key].specifier.contains(pins[pin]), (key, pins[pin])
    if "nvidia-nvshmem-cu13" in req:  # built with the extension: the NVSHMEM it links
        assert str(req["nvidia-nvshmem-cu13"].specifier) == f"=={pins['nvidia-nvshmem-cu13']}"


def test_metadata_ranges_are_the_checked_ones() -> None:
    """setup.py admits exactly the releases the check's table covers, 1.6 to 1.9 with their torch."""
    req = _requires()
    minors = list(stack.TORCH_OF)
    for key, versions in [("torch", list(stack.TORCH_OF.values())), ("gpu:torchrec", minors),
                          ("gpu:fbgemm-gpu", minors), ("cpu:fbgemm-gpu-cpu", minors)]:
        major, first = map(int, versions[0].split("."))
        last = int(versions[-1].split(".")[1])
        inside = [f"{major}.{m}.{p}" for m in range(first, last + 1) for p in (1, 9)]
        outside = [f"{major}.{first - 1}.9", f"{major}.{last + 1}.0"]
        assert all(req[key].specifier.contains(v) for v in inside), (key, req[key])
        assert not any(req[key].specifier.contains(v) for v in outside), (key, req[key])
