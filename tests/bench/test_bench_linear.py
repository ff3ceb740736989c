"""The linear-layer benchmark runs end to end on tiny shapes: one table row per (shape,
rows), the int8 kernel's error column within float32 accumulation error, and bad flags a
one-line error with exit status 2. No timing is asserted (the machine may be shared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_lite.benchmarks import linear


def test_report_rows_and_error_column(tmp_path: Path) -> None:
    argv = ["--shapes", "64x32", "40x12", "--rows", "1", "5", "--target-s", "0.001",
            "--threads", "1", "--out", str(tmp_path)]
    assert linear.main(argv) == 0
    rows = [line for line in (tmp_path / "linear.md").read_text().splitlines()
            if line.startswith("| ") and "x" in line.split("|")[1] and "K x N" not in line]
    assert [(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in rows] == [
        ("64 x 32", "1"), ("64 x 32", "5"), ("40 x 12", "1"), ("40 x 12", "5")]
    for r in rows:
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert all(float(c) > 0 for c in cells[2:9])  # times and speedups
        assert float(cells[9]) < 1e-5  # the int8 kernel vs float64


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
