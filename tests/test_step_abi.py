"""The Python mirror of the kernels' contract (``torchrec_pgas.step_abi``) against ``csrc/step_abi.h``.

The header is compiled here with the host C++ compiler (no CUDA needed), so the check runs on every
machine of CI, with or without the extension; with the extension built, its exported description is
checked too. A field added, removed, resized or reordered on one side fails these tests.
"""

import ctypes
import pathlib
import shutil
import subprocess

import pytest

from torchrec_pgas import step_abi
from torchrec_pgas.layout import StepLayout
from torchrec_pgas.step_abi import BoundsMode, FeatureDesc, StepConfig
from torchrec_pgas.types import PgasError

pytestmark = pytest.mark.stacks

HEADER = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "step_abi.h"


@pytest.fixture(scope="module")
def header_description(tmp_path_factory: pytest.TempPathFactory) -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to compile csrc/step_abi.h")
    work = tmp_path_factory.mktemp("abi")
    (work / "abi.cpp").write_text(
        '#include "step_abi.h"\n#include <vector>\nint main() {\n'
        "  std::vector<char> text(torchrec_pgas::describe_step_abi(nullptr, 0) + 1);\n"
        "  torchrec_pgas::describe_step_abi(text.data(), text.size());\n"
        '  std::fputs(text.data(), stdout);\n}\n'
    )
    exe = work / "abi"
    subprocess.run([cxx, "-std=c++17", f"-I{HEADER.parent}", str(work / "abi.cpp"), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_mirror_matches_the_compiled_header(header_description: str) -> None:
    step_abi.check_against(header_description, "csrc/step_abi.h")


def test_the_header_describes_every_enumerator_it_declares(header_description: str) -> None:
    """``describe_step_abi`` lists enumerators by hand: none of the header's may be missing from it."""
    declared = step_abi.header_enumerators(HEADER.read_text())
    described = [" ".join(line.split()[1:3]) for line in header_description.splitlines() if line.startswith("enum ")]
    assert declared == described and len(declared) > 30


def test_a_drifted_contract_is_refused(header_description: str) -> None:
    moved = header_description.replace("field StepConfig rank 112 4", "field StepConfig rank 116 4")
    assert moved != header_description
    with pytest.raises(PgasError, match=r"only there \['field StepConfig rank 116 4'\]"):
        step_abi.check_against(moved, "a drifted build")


def test_structs_are_built_by_field_name_only() -> None:
    lay = StepLayout(world_size=2, num_features=3, max_batch=8, ids_capacity=64, dim_sum=24, weighted=True)
    config = lay.config(timeout_ns=5, rank=1, bounds_mode=BoundsMode.WARNING, lookup_features=(1, 2))
    assert (config.rank, config.world, config.lookup_f_lo, config.lookup_f_hi, config.weighted) == (1, 2, 1, 2, 1)
    assert config.ids_off == lay.ids_off and config.bounds_mode == BoundsMode.WARNING
    assert bytes(step_abi.as_tensor(config).numpy()) == bytes(config)
    with pytest.raises(PgasError, match=r"fields \['world'\] missing, \['wrold'\] unknown"):
        fields = {name: 0 for name, _ in StepConfig._fields_ if name != "world"}
        step_abi.build(StepConfig, wrold=2, **fields)  # type: ignore[arg-type]


def test_feature_table_words() -> None:
    descs = [step_abi.build(FeatureDesc, **{name: i * 100 + k for k, (name, _) in enumerate(FeatureDesc._fields_)})
             for i in range(3)]
    words = step_abi.as_words(descs, FeatureDesc)
    assert words.shape == (3, ctypes.sizeof(FeatureDesc) // 8)
    assert words[2, FeatureDesc.input_feature.offset // 8] == 212
    assert step_abi.as_words([], FeatureDesc).shape == (0, 13)


def test_extension_exports_the_same_contract() -> None:
    try:
        import torchrec_pgas._C  # noqa: F401
    except ImportError:
        pytest.skip("torchrec_pgas._C not built (no nvcc)")
    step_abi.check_against(step_abi.extension_description(), "the built extension")
