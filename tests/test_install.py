"""The sdist, and the wheel it builds, each installed as the README says into a fresh environment away
from the checkout, on the default stack (CPU flavour): the package and its planner import, the shipped
profiles and constraints files are there, the planner CLI runs, the extension finds NVSHMEM through its
RUNPATH, and a mismatched FBGEMM is refused with a command that fixes it.

Minutes (one build of the extension, two installs of the stack): deselected by default, CI runs it (-m install).
The first test also sets the module's environments up, inside its own time limit: 30 minutes, not pytest's 10.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
from typing import Callable, Iterator, List, Optional, Tuple

import pytest

from torchrec_pgas import stack

pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSTRAINTS = str(stack.constraints_file(stack.DEFAULT_STACK))
MODEL = """world_size: 2
batch_per_rank: 4096
tables:
  - {name: user_id, rows: 10000000, dim: 64, pooling: 1}
  - {name: categories, rows: 10000, dim: 32, pooling: [4, 8]}
"""
# Run inside an installed environment: where the package came from and what it ships.
REPORT = """
import json, pathlib, torchrec_pgas, torchrec_pgas.planner
from torchrec_pgas import stack
from torchrec_pgas.planner.cost_model import load_profile
profiles = sorted(pathlib.Path(torchrec_pgas.planner.__file__).parent.glob("profiles/*.json"))
print(json.dumps({"package": torchrec_pgas.__file__, "profiles": [load_profile(str(p)).name for p in profiles],
                  "stacks": [str(stack.constraints_file(s)) for s in stack.tested_stacks()]}))
"""
# _C loaded after torch: the NVSHMEM host library in the process is the environment's.
LOADED_NVSHMEM = """
import json, torch, torchrec_pgas._C
print(json.dumps(sorted({line.split()[-1] for line in open("/proc/self/maps") if "libnvshmem_host" in line})))
"""


def _run(args: List[str], cwd: pathlib.Path, env_dir: Optional[pathlib.Path] = None) -> str:
    """A command, in env_dir's environment where one is given: its bin/ first on PATH, nothing of the
    checkout's on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if env_dir is not None:
        env["PATH"] = f"{env_dir / 'bin'}:{env['PATH']}"
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _pip(env_dir: pathlib.Path, *args: str) -> None:
    _run(["bash", str(ROOT / "scripts" / "pip_install.sh"), str(env_dir / "bin" / "python"), *args], env_dir, env_dir)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(ROOT)], out)
    return next(out.glob("*.tar.gz"))


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], pathlib.Path]]:
    """Makes empty venvs, removed after this module's tests: installed, each holds gigabytes."""
    made: List[pathlib.Path] = []

    def make(name: str) -> pathlib.Path:
        made.append(tmp_path_factory.mktemp(name) / "env")
        subprocess.run([sys.executable, "-m", "venv", str(made[-1])], check=True)
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path)


@pytest.fixture(scope="module")
def sdist_env(sdist: pathlib.Path, fresh_env: Callable[[str], pathlib.Path]) -> Tuple[pathlib.Path, pathlib.Path]:
    """The sdist installed as the README says (torch first, then --no-build-isolation), in two pip steps: the
    wheel it builds (the extension: nvcc and CUDA torch are here), then that wheel, which ``pip install`` of the
    sdist does in one. The module's one build of the extension: the wheel test installs the same wheel."""
    env_dir = fresh_env("sdist")
    _pip(env_dir, "torch", "setuptools", "wheel", "ninja", "-c", CONSTRAINTS)
    wheels = env_dir.parent / "wheels"
    _run([str(env_dir / "bin" / "python"), "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
          "-w", str(wheels), str(sdist)], env_dir, env_dir)
    wheel = next(wheels.glob("*.whl"))
    _pip(env_dir, f"{wheel}[cpu]", "-c", CONSTRAINTS)
    _pip(env_dir, "--no-deps", "torchrec", "-c", CONSTRAINTS)
    return env_dir, wheel


@pytest.fixture(scope="module")
def wheel_env(sdist_env: Tuple[pathlib.Path, pathlib.Path], fresh_env: Callable[[str], pathlib.Path]) -> pathlib.Path:
    env_dir = fresh_env("wheel")
    _pip(env_dir, f"{sdist_env[1]}[cpu]", "-c", CONSTRAINTS)
    _pip(env_dir, "--no-deps", "torchrec", "-c", CONSTRAINTS)
    return env_dir


def _check_installed(env_dir: pathlib.Path) -> None:
    """What every install must give, checked from a folder that is not the checkout."""
    py = str(env_dir / "bin" / "python")
    report = json.loads(_run([py, "-c", REPORT], env_dir, env_dir))
    assert report["package"].startswith(str(env_dir)), report
    assert report["profiles"] and all(report["profiles"]), report
    assert [pathlib.Path(s).name for s in report["stacks"]] == ["torchrec-1.6.txt", "torchrec-1.9.txt"]
    assert all(s.startswith(str(env_dir)) and pathlib.Path(s).is_file() for s in report["stacks"])
    (env_dir / "model.yaml").write_text(MODEL)
    out = _run([py, "-m", "torchrec_pgas.planner.explain", "model.yaml"], env_dir, env_dir)
    assert re.search(r"^user_id\s", out, re.M) and re.search(r"^categories\s", out, re.M), out
    assert "step: all" in out, out
    # torchrec went in --no-deps: its fbgemm-gpu is the one requirement pip check may find missing
    check = subprocess.run([py, "-m", "pip", "check"], capture_output=True, text=True).stdout.splitlines()
    assert all(re.fullmatch(r"torchrec [\d.]+ requires fbgemm-gpu, which is not installed\.", c) for c in check), check


def _extension(env_dir: pathlib.Path) -> pathlib.Path:
    found = list((env_dir / "lib").glob("python3*/site-packages/torchrec_pgas/_C*.so"))
    assert len(found) == 1, found
    return found[0]


def test_wheel_installs_and_runs_away_from_the_checkout(wheel_env: pathlib.Path) -> None:
    _check_installed(wheel_env)
    so = _extension(wheel_env)
    dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert re.findall(r"R(?:UN)?PATH.*\[(.*)\]", dynamic) == ["$ORIGIN/../nvidia/nvshmem/lib"], dynamic
    nvshmem_lib = next(wheel_env.glob("lib/python3*/site-packages/nvidia/nvshmem/lib"))
    # The RUNPATH alone (no torch loaded, no LD_LIBRARY_PATH) finds the environment's host library.
    ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}).stdout
    host = os.path.realpath(nvshmem_lib / "libnvshmem_host.so.3")
    found = re.search(r"libnvshmem_host\.so\.3 => (\S+)", ldd)
    assert found and os.path.realpath(found.group(1)) == host, ldd
    loaded = _run([str(wheel_env / "bin" / "python"), "-c", LOADED_NVSHMEM], wheel_env, wheel_env)
    assert [os.path.realpath(p) for p in json.loads(loaded)] == [host], loaded


def test_mismatched_fbgemm_is_refused_and_the_printed_command_fixes_it(wheel_env: pathlib.Path) -> None:
    py = str(wheel_env / "bin" / "python")
    _pip(wheel_env, "--no-deps", "fbgemm-gpu-cpu==1.9.0")  # what an unpinned upgrade would bring
    proc = subprocess.run([py, "-c", "import torchrec_pgas"], cwd=wheel_env, capture_output=True, text=True)
    assert proc.returncode != 0 and "StackError" in proc.stderr, proc.stderr[-3000:]
    assert "installed: torch 2.11.0, fbgemm-gpu-cpu 1.9.0, torchrec 1.6.1" in proc.stderr
    assert "- FBGEMM 1.9.0 needs torch 2.14, not 2.11.0" in proc.stderr
    fix = next(line.strip()[len("CPU: "):] for line in proc.stderr.splitlines() if line.strip().startswith("CPU: "))
    shipped = next(wheel_env.glob("lib/python3*/site-packages/torchrec_pgas/stacks/torchrec-1.6.txt"))
    assert f"-c {shipped} " in fix, fix  # the installed torch's stack, as the environment has it
    _run(["bash", "-c", fix], wheel_env, wheel_env)
    _run([py, "-c", "import torchrec_pgas"], wheel_env, wheel_env)


def test_sdist_builds_and_installs_away_from_the_checkout(sdist: pathlib.Path,
                                                          sdist_env: Tuple[pathlib.Path, pathlib.Path]) -> None:
    """The sdist carries what the extension's build needs (csrc/, headers included), and builds against the
    torch it will run with."""
    with tarfile.open(sdist) as archive:
        members = {pathlib.Path(*pathlib.Path(name).parts[1:]) for name in archive.getnames()}
    tracked = _run(["git", "ls-files", "csrc", "torchrec_pgas/stacks"], ROOT).split()
    assert {pathlib.Path(f) for f in tracked} <= members, sorted(members)
    _check_installed(sdist_env[0])
    _extension(sdist_env[0])
