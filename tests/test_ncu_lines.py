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
