"""The linear-layer benchmark runs end to end on tiny shapes, in cache and --cold, float32
and bfloat16: one table row per (shape, rows), the engine's and the int8 kernel's error
columns within accumulation (and bf16 output rounding) error, and bad flags a one-line
error with exit status 2. The oneDNN peer's columns are n/a, with torch's reason under the
table, where torch cannot run its prepacked GEMM in that dtype on this CPU (bf16 without
AVX-512 or AVX-NE-CONVERT), never a crash. No timing is asserted (the machine may be
shared)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import linear

ONEDNN_COLUMNS = (3, 7)  # the oneDNN time and speedup cells


def onednn_error(dtype: torch.dtype) -> str | None:
    """torch's own answer, asked directly: its error where oneDNN cannot prepack ``dtype``
    weights on this CPU, else None."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=dtype), 16)
    except RuntimeError as e:
        return str(e)
    return None


def table_rows(report: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in report.splitlines()
            if line.startswith("| ") and "x" in line.split("|")[1] and "K x N" not in line]


def check_onednn_cells(report: str, cells: list[str], reason: str | None) -> None:
    """Where torch cannot run the peer (``reason``), its cells are n/a and the report quotes
    torch's error; elsewhere they are positive numbers."""
    if reason is None:
        assert all(float(cells[i]) > 0 for i in ONEDNN_COLUMNS)
        assert "n/a on this CPU" not in report
    else:
        assert [cells[i] for i in ONEDNN_COLUMNS] == ["n/a", "n/a"]
        assert reason.splitlines()[0].strip() in report


@pytest.mark.parametrize("extra", [[], ["--cold"], ["--dtype", "bfloat16"]])
def test_report_rows_and_error_column(tmp_path: Path, extra: list[str]) -> None:
    argv = ["--shapes", "64x32", "48x12", "--rows", "1", "5", "--target-s", "0.001",
            "--threads", "1", "--out", str(tmp_path)] + extra
    assert linear.main(argv) == 0
    report = (tmp_path / "linear.md").read_text()
    rows = table_rows(report)
    assert [(cells[0], cells[1]) for cells in rows] == [
        ("64 x 32", "1"), ("64 x 32", "5"), ("48 x 12", "1"), ("48 x 12", "5")]
    bf16 = "bfloat16" in extra
    reason = onednn_error(torch.bfloat16 if bf16 else torch.float32)
    for cells in rows:
        # times and speedups
        assert all(float(c) > 0 for i, c in enumerate(cells[2:11], 2) if i not in ONEDNN_COLUMNS)
        check_onednn_cells(report, cells, reason)
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
    report = (tmp_path / "linear.md").read_text()
    [cells] = table_rows(report)
    assert cells[6] == "n/a" and cells[10] == "n/a" and float(cells[2]) > 0
    check_onednn_cells(report, cells, onednn_error(torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_onednn_column_na_where_torch_refuses(tmp_path: Path, dtype: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The n/a path on every CPU: torch's prepacking made to refuse (as its bf16 one does
    on AVX2-only CPUs) leaves the oneDNN cells n/a, the reason under the table, and every
    other column measured."""
    message = "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"

    def refuse(w: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"mkldnn_reorder_linear_weight: {message}")

    monkeypatch.setattr(linear, "_onednn_pack", refuse)
    argv = ["--shapes", "64x32", "--rows", "2", "--target-s", "0.001", "--threads", "1",
            "--dtype", dtype, "--out", str(tmp_path)]
    assert linear.main(argv) == 0
    report = (tmp_path / "linear.md").read_text()
    [cells] = table_rows(report)
    check_onednn_cells(report, cells, message)
    assert all(float(c) > 0 for i, c in enumerate(cells[2:11], 2) if i not in ONEDNN_COLUMNS)
