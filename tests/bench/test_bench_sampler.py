"""vllm-lite bench sampler on small sizes: every setting timed for both samplers (the
run itself checks greedy tokens agree and random draws stay in their kept sets), and bad
sizes refused."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import sampler  # noqa: E402


def _args(out: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sampler.add_arguments(p)
    return p.parse_args(["--target-s", "0.001", "--threads", "1", "--out", str(out), *extra])


def test_every_setting_timed_for_both(tmp_path: Path) -> None:
    report = sampler.run(_args(tmp_path, "--rows", "1", "5", "--vocab", "700"))
    rows = re.findall(r"^\| ([a-z_0-9., ]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      report, re.M)
    assert sorted((name, int(m)) for name, m, *_ in rows) == sorted(
        (name, m) for name in sampler.SETTINGS for m in (1, 5)), report
    assert all(float(ours) > 0 and float(hf) > 0 for _, _, ours, hf, _ in rows)


@pytest.mark.parametrize("extra,match", [
    (["--rows", "0"], "--rows must be >= 1"),
    (["--vocab", "100"], "--vocab must be >= 214"),
])
def test_bad_sizes_are_refused(tmp_path: Path, extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sampler.run(_args(tmp_path, *extra))
