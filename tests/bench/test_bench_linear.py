"""The linear-layer benchmark runs end to end on tiny shapes, in cache and --cold, float32
and bfloat16: one table row per (shape, rows), the engine's and the int8 kernel's error
columns within accumulation (and bf16 output rounding) error, and bad flags a one-line
error with exit status 2. No timing is asserted (the machine may be shared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_lite.benchmarks import linear


@pytest.mark.parametrize("extra", [[], ["--cold"], ["--dtype", "bfloat16"]])
def test_report_rows_and_error_column(tmp_path: Path, extra: list[str]) -> None:
    argv = ["--shapes", "64x32", "48x12", "--rows", "1", "5", "--target-s", "0.001",
            "--threads", "1", "--out", str(tmp_path)] + extra
    assert linear.main(argv) == 0
    rows = [line for line in (tmp_path / "linear.md").read_text().splitlines()
            if line.startswith("| ") and "x" in line.split("|")[1] and "K x N" not in line]
    assert [(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in rows] == [
        ("64 x 32", "1"), ("64 x 32", "5"), ("48 x 12", "1"), ("48 x 12", "5")]
    for r in rows:
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert all(float(c) > 0 for c in cells[2:11])  # times and speedups
        bf16 = "bfloat16" in extra
        assert float(cells[11]) < (4e-3 if bf16 else 1e-5)  # the engine's GEMM vs float64
        assert float(cells[12]) < (4e-3 if bf16 else 1e-5)  # the int8 kernel vs float64


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "5"], "--shapes"),
    (["--shapes", "0x4"], "--shapes"),
    (["--rows", "0"], "--rows"),
])
def test_bad_flags(tmp_path: Path, argv: list[str], message: str,
                   capsys: pytest.CaptureFixture) -> None:
    assert linear.main(argv + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_torch_int8_column_na_where_torch_crashes(tmp_path: Path) -> None:
    """bf16 with K not a multiple of 16: torch's int8 op segfaults, so it is not called."""
    argv = ["--shapes", "40x12", "--rows", "3", "--target-s", "0.001", "--threads", "1",
            "--dtype", "bfloat16", "--out", str(tmp_path)]
    assert linear.main(argv) == 0
    row = [line for line in (tmp_path / "linear.md").read_text().splitlines()
           if line.startswith("| 40 x 12")][0]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[6] == "n/a" and cells[10] == "n/a" and float(cells[2]) > 0
