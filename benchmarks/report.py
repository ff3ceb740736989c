"""Benchmark reports: the machine, markdown tables, JSON, and matplotlib figures."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import torch

from . import RESULTS_DIR

logger = logging.getLogger(__name__)

DEFAULT_OUT = RESULTS_DIR


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: numbers to ``digits`` significant digits, None as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if value == 0:
            return "0"
        if abs(value) >= 10 ** digits:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def pct(fraction: float | None, digits: int = 2) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.{digits}f}%"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |")
    return "\n".join(lines)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def machine_info(device: torch.device, threads: int) -> dict[str, Any]:
    """What a reader needs to judge the numbers: hardware, threads, versions, load."""
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "commit": _git_commit(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        try:
            from vllm_lite import ops

            info["cpu_isa"] = ops.cpu_isa()
        except Exception:  # the extension is optional for describing the machine
            info["cpu_isa"] = None
    return info


def describe_machine(info: dict[str, Any]) -> str:
    parts = [f"{info['cpu']}, {info['cores']} cores, {info['threads']} threads"]
    if info.get("gpu"):
        parts.insert(0, info["gpu"])
    if info.get("cpu_isa"):
        parts.append(f"CPU ISA {info['cpu_isa']}")
    parts.append(f"torch {info['torch']}")
    if info.get("transformers"):
        parts.append(f"transformers {info['transformers']}")
    if info.get("commit"):
        parts.append(f"commit {info['commit']}")
    load = [info.get("load_avg_start"), info.get("load_avg_end")]
    if any(x is not None for x in load):
        parts.append("load average " + " -> ".join(fmt(x) for x in load if x is not None))
    return ", ".join(parts)


@dataclass
class Report:
    """A markdown document built section by section, saved with its JSON and figures."""

    title: str
    out_dir: Path
    stem: str
    sections: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    figures: list[Path] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.sections.append(text.rstrip() + "\n")

    def figure(self, suffix: str, draw: Callable[[Any], None], caption: str = "") -> Path | None:
        """Draws a matplotlib figure with ``draw(plt)`` into ``<stem>_<suffix>.png``; a
        missing matplotlib or a failing plot is logged, never fatal (the tables matter)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed: no figure %s (pip install matplotlib)",
                           suffix)
            return None
        path = self.out_dir / f"{self.stem}_{suffix}.png"
        try:
            draw(plt)
            plt.tight_layout()
            plt.savefig(path, dpi=110)
        except Exception:
            logger.exception("figure %s failed", suffix)
            return None
        finally:
            plt.close("all")
        self.figures.append(path)
        self.add(f"![{caption or suffix}]({path.name})")
        return path

    def save(self) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        md = self.out_dir / f"{self.stem}.md"
        md.write_text(f"# {self.title}\n\n" + "\n".join(self.sections))
        (self.out_dir / f"{self.stem}.json").write_text(
            json.dumps(self.data, indent=1, default=str) + "\n")
        return md


def make_report(title: str, kind: str, out_dir: Path | str, device: torch.device,
                dtype_name: str) -> Report:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{kind}_{device.type}_{dtype_name}_{time.strftime('%Y%m%d-%H%M%S')}"
    return Report(title=title, out_dir=out, stem=stem)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def print_summary(report: Report) -> None:
    """The command line's output: the report's text and tables, and where the files are."""
    print("\n".join(s for s in report.sections if not s.startswith("![")))
    print(f"written: {report.out_dir / (report.stem + '.md')} (+ .json, "
          f"{len(report.figures)} figure(s))")
