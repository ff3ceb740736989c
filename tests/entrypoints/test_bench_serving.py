"""benchmarks/serving.py against a test server: a short sweep writes its table, JSON and plot;
its percentiles equal numpy's (linear interpolation)."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_serving", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_percentiles_match_numpy(bench: Any) -> None:
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        got = bench.percentiles(values + [math.nan])  # failed requests carry NaN
        for p in (50, 95, 99):
            assert got[f"p{p}"] == pytest.approx(float(np.percentile(values, p)), rel=1e-12)
    assert all(math.isnan(v) for v in bench.percentiles([]).values())


def test_sweep_against_a_server(bench: Any, server: Any, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code = bench.main(["--base-url", server.url, "--rates", "20", "inf", "--num-prompts", "4",
                       "--input-len", "6", "--output-len", "5", "--out", str(tmp_path)])
    assert code == 0
    (md,) = tmp_path.glob("serving_*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert md.with_suffix(".png").stat().st_size > 0
    assert [r["rate"] for r in data["results"]] == ["20", "inf"]
    for r in data["results"]:
        assert r["num_requests"] == 4 and r["num_failed"] == 0
        # Exactly output_len tokens each (ignore_eos), all counted by the server too.
        assert r["output_throughput"] * r["duration_s"] == pytest.approx(4 * 5)
        assert r["server"]["generation_tokens"] == 4 * 5
        assert 0 < r["ttft"]["p50"] <= r["ttft"]["p99"] <= r["e2e"]["p99"]
    assert "| inf | 4 / 4 |" in md.read_text()


def test_batching_delay_sweep_starts_one_server_per_delay(bench: Any, model_dir: Path,
                                                           tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code = bench.main(["--model", str(model_dir), "--kv-cache-space", "0.01", "--threads", "1",
                       "--batching-delay-ms", "0", "80", "--rates", "inf",
                       "--num-prompts", "4", "--input-len", "6", "--output-len", "4",
                       "--out", str(tmp_path)])
    assert code == 0
    (md,) = tmp_path.glob("serving_*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert [(r["batching_delay_ms"], r["rate"]) for r in data["results"]] == \
        [(0.0, "inf"), (80.0, "inf")]
    assert all(r["num_failed"] == 0 for r in data["results"])
    # 4 requests at once, fewer than max_num_seqs: the 80 ms server holds them all for
    # its delay (an idle engine): the median request waited it.
    held = data["results"][1]
    assert held["ttft"]["p50"] >= 0.08
    assert "| 80 | inf | 4 / 4 |" in md.read_text()


def test_batching_delay_is_refused_with_a_running_server(bench: Any) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--base-url", "http://127.0.0.1:1", "--batching-delay-ms", "5"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--batching-delay-ms", "-1"])
