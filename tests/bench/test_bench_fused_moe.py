"""`vllm-lite bench moe` (benchmarks/moe.py) on a tiny block, float experts only: one row
per (dtype, tokens), both sides timed, the op's and the torch block's errors against
float64 within accumulation (and bf16 rounding) error; bad sizes a one-line error naming
the flag and exit status 2. No timing is asserted (the machine may be shared)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import vllm_lite
from vllm_lite import ops
from vllm_lite.entrypoints import cli

REPO = Path(__file__).resolve().parents[2]
TINY = ["--experts", "4", "--top-k", "2", "--hidden", "40", "--intermediate", "24",
        "--target-s", "0.001", "--threads", "1", "--no-quantized"]
# A row's float columns (the quantized experts' columns, off here, would follow).
ROW = re.compile(r"^\| (\w+) \| ([^|]+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.e+-]+) "
                 r"\| ([\d.e+-]+) \|$", re.M)


@pytest.fixture(autouse=True)
def _checkout_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    if Path(vllm_lite.__file__).resolve().parents[1] != REPO:
        pytest.skip("vllm_lite is imported from an installed package, not this checkout")
    monkeypatch.delenv(cli.BENCHMARKS_ENV, raising=False)


def test_every_cell_timed_and_close(tmp_path: Path) -> None:
    # 300 tokens: past ERROR_ROWS, so the errors cover its first rows.
    rc = cli.main(["bench", "moe", *TINY, "--tokens", "1", "5", "300", "--dtypes", "float32",
                   "bfloat16", "--out", str(tmp_path)])
    assert rc == 0
    report = (tmp_path / "moe.md").read_text()
    rows = ROW.findall(report)
    assert [(r[0], int(r[2])) for r in rows] == [
        (d, t) for d in ("float32", "bfloat16") for t in (1, 5, 300)], report
    for dtype, gemms, _, ours, theirs, ratio, err, err_torch in rows:
        assert int(ours) >= 0 and int(theirs) >= 0 and float(ratio) > 0
        tol = 1e-5 if dtype == "float32" else 2e-2
        assert float(err) < tol and float(err_torch) < tol, (dtype, err, err_torch)
        if ops.cpu_isa() == "generic":
            assert gemms.strip() == "ATen"


@pytest.mark.parametrize("extra,flag", [
    (["--device", "cuda", "--quantized"], "--quantized"),  # the quantized experts: CPU only
    pytest.param(["--device", "cuda"], "--device cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
    (["--tokens", "0"], "--tokens"),
    (["--experts", "0"], "--experts"),
    (["--top-k", "5"], "--top-k"),
    (["--hidden", "0"], "--hidden"),
    (["--target-s", "0"], "--target-s"),
    (["--quantized", "--int4-group", "32"], "--int4-group"),  # 32 does not divide 40
])
def test_bad_sizes_exit_2_naming_the_flag(tmp_path: Path, extra: list[str], flag: str,
                                          capsys: pytest.CaptureFixture) -> None:
    argv = TINY + extra
    assert cli.main(["bench", "moe", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "moe.md").exists()
