"""scripts/ncu_lines.py on a tiny file in the layout of `ncu --page source --csv --print-source cuda,sass`."""

import csv
import gzip
import importlib.util
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ncu_lines", os.path.join(os.path.dirname(__file__), "..", "scripts", "ncu_lines.py"))
ncu_lines = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ncu_lines)

HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "# Samples", "Instructions Executed",
          "stall_long_sb", "stall_wait", "stall_wait (Not Issued)"]


def _write(path: str, opener) -> None:
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for file, lines in (("/x/csrc/a.cu", [("10", "x = y;", "1,000", "30", "20", "10"),
                                               ("11", "z = x;", "-", "0", "0", "0")]),
                            ("/x/include/b.hpp", [("10", "return v;", "3000", "10", "0", "10")])):
            w.writerow(["File Path", file])
            w.writerow(["Function Name", "kernel"])
            w.writerow(HEADER)
            for no, src, inst, samples, long_sb, wait in lines:
                w.writerow([no, src, "-", "-", samples, "0", samples, inst, long_sb, wait, "99"])
                # a SASS row of that line: not a source line, not counted again
                w.writerow(["", "", "0x10", "IADD3 R1, R2, R3", samples, "0", samples, inst, long_sb, wait, "99"])


@pytest.mark.parametrize("gz", [False, True])
def test_lines_and_stalls_are_summed_per_file_and_line(tmp_path, gz: bool) -> None:
    path = str(tmp_path / ("src.csv.gz" if gz else "src.csv"))
    _write(path, gzip.open if gz else open)
    lines, stalls = ncu_lines.line_totals(path)
    assert lines[("a.cu", 10)][:2] == [1000.0, 30.0]  # thousands separators parsed
    assert lines[("a.cu", 11)][:2] == [0.0, 0.0]  # "-": no counter
    assert lines[("b.hpp", 10)] == [3000.0, 10.0, "return v;"]  # same line number, other file
    assert stalls == {"long_sb": 20.0, "wait": 20.0}  # the "(Not Issued)" columns are left out


def test_loops_are_the_sass_ranges_a_branch_returns_to(tmp_path) -> None:
    """A branch back to an earlier address closes a loop (nested ones too), counted over the SASS rows of the
    named kernel only, from every file section the export splits them into; a forward branch is no loop."""
    path = str(tmp_path / "src.csv")
    sass = {"walk<float>": [("0x1100", "LDG.E R1, desc[UR4][R2.64]", "5", "100"),
                            ("0x1110", "FADD R1, R1, R3", "1", "400"),
                            ("0x1120", "STL [R1+0x4], R1", "2", "400")],
            "other": [("0x2100", "BRA 0x2100", "50", "50")]}
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for fn, rows in sass.items():
            w.writerow(["File Path", "/x/csrc/a.cu"])
            w.writerow(["Function Name", fn])
            w.writerow(HEADER)
            for at, instruction, samples, inst in rows:
                w.writerow(["", "", at, instruction, samples, "0", samples, inst, "0", "0", "0"])
        w.writerow(["File Path", "/x/csrc/b.h"])  # the same kernel's SASS under another source file
        w.writerow(["Function Name", "walk<float>"])
        w.writerow(HEADER)
        for at, instruction, samples, inst in [("0x1130", "@P0 BRA 0x1110", "3", "400"),
                                               ("0x1140", "BRA `(0x1100)", "1", "100"),
                                               ("0x1150", "BRA 0x1170", "0", "100"), ("0x1170", "EXIT", "0", "1")]:
            w.writerow(["", "", at, instruction, samples, "0", samples, inst, "0", "0", "0"])
    loops, samples, executed = ncu_lines.loop_totals(path, "walk")
    assert (samples, executed) == (12.0, 1501.0)
    assert loops == [ncu_lines.Loop(0x0, 0x40, 5, 1, 1, 12.0, 1400.0), ncu_lines.Loop(0x10, 0x30, 3, 0, 1, 6.0, 1200.0)]
    assert ncu_lines.loop_totals(path, "absent") == ([], 0.0, 0.0)
