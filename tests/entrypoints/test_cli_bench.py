"""`vllm-lite bench`: the benchmarks live in the checkout's benchmarks/, outside the package.
From a checkout it finds and runs them; from an installed package without one it exits 2
with one line saying where they are; other commands never look for them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_lite
from vllm_lite.entrypoints import cli

REPO = Path(__file__).resolve().parents[2]


def test_finds_the_checkouts_benchmarks(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv(cli.BENCHMARKS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # beside the imported package, not the working directory
    if Path(vllm_lite.__file__).resolve().parents[1] != REPO:
        pytest.skip("vllm_lite is imported from an installed package, not this checkout")
    assert cli.benchmarks_dir() == REPO / "benchmarks"
    out = tmp_path / "out"
    rc = cli.main(["bench", "linear", "--shapes", "64x32", "--rows", "1", "--target-s", "0.001",
                   "--threads", "1", "--out", str(out)])
    assert rc == 0 and (out / "linear.md").is_file()


def test_without_a_checkout_says_where_they_are(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: None)
    for argv in (["bench", "throughput", "--quick"], ["bench"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "benchmarks/ folder" in err and cli.BENCHMARKS_ENV in err
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "source checkout" in " ".join(capsys.readouterr().out.split())


def test_env_var_must_name_a_benchmarks_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(cli.BENCHMARKS_ENV, str(tmp_path))
    assert cli.main(["bench", "linear", "--help"]) == 2
    err = capsys.readouterr().err
    assert cli.BENCHMARKS_ENV in err and str(tmp_path) in err
    monkeypatch.setenv(cli.BENCHMARKS_ENV, str(REPO / "benchmarks"))
    assert cli.benchmarks_dir() == REPO / "benchmarks"


def test_other_commands_never_look(monkeypatch, capsys) -> None:
    def looked() -> None:
        raise AssertionError("benchmarks_dir called")

    monkeypatch.setattr(cli, "benchmarks_dir", looked)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench" in capsys.readouterr().out


def test_installed_package_outside_and_inside_a_checkout(tmp_path: Path) -> None:
    """A copy of the package (no benchmarks beside it, as pip installs it): the working
    directory's checkout is found; elsewhere, the one-line message."""
    site = tmp_path / "site"
    shutil.copytree(Path(vllm_lite.__file__).parent, site / "vllm_lite",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", cli.BENCHMARKS_ENV)}
    env["PYTHONPATH"] = str(site)
    run = [sys.executable, "-P", "-c", "import sys, vllm_lite; from vllm_lite.entrypoints.cli "
           "import main; assert vllm_lite.__file__.startswith(sys.argv[1]); "
           "sys.exit(main(sys.argv[2:]))", str(site)]
    elsewhere = subprocess.run(run + ["bench", "kernels", "--quick"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode == 2, elsewhere.stderr
    assert elsewhere.stderr.count("\n") == 1 and "benchmarks/ folder" in elsewhere.stderr
    inside = subprocess.run(run + ["bench", "kernels", "--help"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert inside.returncode == 0 and "--goal-copy-bw" in inside.stdout, inside.stderr
