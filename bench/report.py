"""Benchmark results: metrics with optional targets, printed as a table and saved as JSON."""

from __future__ import annotations

import argparse
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
}


@dataclass
class Metric:
    name: str
    value: float | None
    unit: str
    # ("<=", 10.0) means the value must be at most 10; None: informational.
    target: tuple[str, float] | None = None
    note: str = ""

    @property
    def ok(self) -> bool | None:
        if self.target is None:
            return None
        if self.value is None or math.isnan(self.value):
            return False
        op, bound = self.target
        return _OPS[op](self.value, bound)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "target": None
            if self.target is None
            else {"op": self.target[0], "value": self.target[1]},
            "ok": self.ok,
            "note": self.note,
        }


@dataclass
class Results:
    title: str
    metrics: list[Metric] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(
        self,
        name: str,
        value: float | None,
        unit: str,
        target: tuple[str, float] | None = None,
        note: str = "",
    ) -> Metric:
        metric = Metric(name, value, unit, target, note)
        self.metrics.append(metric)
        return metric

    @property
    def missed(self) -> list[Metric]:
        return [m for m in self.metrics if m.ok is False]

    def table(self) -> str:
        rows = [("metric", "value", "target", "ok?")]
        for m in self.metrics:
            value = "n/a" if m.value is None else f"{_fmt(m.value)} {m.unit}".rstrip()
            target = "-" if m.target is None else f"{m.target[0]} {_fmt(m.target[1])} {m.unit}"
            ok = "-" if m.ok is None else ("yes" if m.ok else "NO")
            rows.append((m.name, value, target.rstrip(), ok))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [self.title, ""]
        for i, r in enumerate(rows):
            lines.append(
                "  ".join(
                    cell.ljust(w) if j == 0 else cell.rjust(w)
                    for j, (cell, w) in enumerate(zip(r, widths, strict=True))
                ).rstrip()
            )
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        for err in self.errors:
            lines.append(f"error: {err}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "metrics": [m.to_json() for m in self.metrics],
            "missed": [m.name for m in self.missed],
            "errors": self.errors,
            "details": self.details,
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)


def side_by_side(title: str, runs: dict[str, Results]) -> str:
    """One table for the same benchmark run with different settings (the drivers): a row per
    metric, a value column per run, each run's target and verdict.
    """
    names: list[str] = []
    for results in runs.values():
        names += [m.name for m in results.metrics if m.name not in names]
    header = ["metric", *runs, "target", "ok?"]
    rows = [header]
    for name in names:
        found = {k: next((m for m in r.metrics if m.name == name), None) for k, r in runs.items()}
        cells = [name]
        targets, oks = [], []
        for metric in found.values():
            if metric is None:
                cells.append("")
                targets.append("-")
                oks.append("-")
                continue
            value = "n/a" if metric.value is None else f"{_fmt(metric.value)} {metric.unit}"
            cells.append(value.rstrip())
            targets.append(
                "-" if metric.target is None else f"{metric.target[0]} {_fmt(metric.target[1])}"
            )
            oks.append("-" if metric.ok is None else ("yes" if metric.ok else "NO"))
        same = len(set(targets)) == 1
        cells.append(targets[0] if same else " / ".join(targets))
        cells.append(oks[0] if len(set(oks)) == 1 else " / ".join(oks))
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [title, ""]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.ljust(w) if j == 0 else cell.rjust(w)
                for j, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for key, results in runs.items():
        lines += [f"error ({key}): {err}" for err in results.errors]
    return "\n".join(lines)


def write_runs(path: Path, title: str, runs: dict[str, Results]) -> None:
    """Several runs' results as one JSON file: {"title", "runs": {key: results}}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    data = {"title": title, "runs": {k: r.to_json() for k, r in runs.items()}}
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    if value == int(value) and abs(value) >= 100:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 200 samples is the 198th smallest)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def finish(results: Results, out: Path | None, strict: bool) -> int:
    """Print the table, write the JSON to `out` when given, and return the exit status: 1 on
    an error (or, with `strict`, a missed target), else 0."""
    print(results.table())
    if out is not None:
        results.write(out)
    return 1 if results.errors or (strict and results.missed) else 0


def main(
    run: Callable[..., int], prog: str, doc: str | None, quick_help: str, argv: list[str] | None
) -> int:
    """The command line of a benchmark module: `--quick`, `--out FILE`, `--strict`, then
    `run(quick=, out=, strict=)`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a target is missed"
    )
    args = parser.parse_args(argv)
    return run(quick=args.quick, out=args.out, strict=args.strict)
