"""The README's headline table (and its copy in docs/benchmarks.md) holds the numbers of docs/results/ordinary.json,
the run it cites: every speed-up, accuracy (MiniLM: cosine) and integer-kernel count, to the digits printed.

A table copied by hand drifts from the results it cites when the bench is rerun; this test reads both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import ordinary as O

ROOT = Path(__file__).resolve().parents[1]
HEADER = "| model | FP32 acc | lq default (`int8_onnxruntime`) | lq `int8_reduce_range` | ORT `quantize_static` u8s8 |"
NUMBER = re.compile(r"(\d+(?:\.\d+)?)")


def _table(text: str) -> list[list[str]]:
    """The cells of each row of the headline table (the one under :data:`HEADER`)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _close(printed: str, value: float) -> bool:
    """``printed`` (a number as a table shows it) is ``value`` rounded to the digits shown."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(float(printed) - value) <= 0.5 * 10 ** -decimals + 1e-9


def _check_cell(cell: str, speedup: float, quality: float, cosine: bool, where: str) -> None:
    """``"1.16x, 95.56%"`` (or ``"1.42x, **0.9906**"``): the speed-up, then the accuracy or cosine."""
    speed, qual = (NUMBER.search(part).group(1) for part in cell.split(",", 1))
    assert _close(speed, speedup), (where, cell, speedup)
    assert _close(qual, quality / 100 if cosine else quality), (where, cell, quality)


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md"])
def test_headline_table_holds_the_cited_run(doc):
    res = json.loads((ROOT / "docs/results/ordinary.json").read_text())
    rows = _table((ROOT / doc).read_text())
    assert len(rows) == len(res["rows"]), (doc, [r[0] for r in rows])
    for cells, r in zip(rows, res["rows"], strict=True):
        where = f"{doc}: {cells[0]} vs {r['model']}"
        first = re.compile(r"[\w-]+")
        assert first.match(cells[0]).group() == first.match(r["model"]).group(), where  # same model, same order
        cosine = "metric" in r
        fp32 = NUMBER.search(cells[1]).group(1)
        assert _close(fp32, r["acc"]["FP32"] / 100 if cosine else r["acc"]["FP32"]), (where, cells[1])
        for cell, name in zip(cells[2:5], (O.LQ_RECIPE, O.LQ_REDUCE, O.ORT_QS), strict=True):
            _check_cell(cell, r["speedup"][name]["median"], r["acc"][name], cosine, f"{where}, {name}")
        pairs = re.findall(r"(\d+) / (\d+)", cells[5])
        k = r["kernels"]
        want = [(k[O.LQ_RECIPE]["integer"], k[O.LQ_RECIPE]["layers"])]
        if (k[O.LQ_REDUCE]["integer"], k[O.LQ_REDUCE]["layers"]) != want[0]:
            want.append((k[O.LQ_REDUCE]["integer"], k[O.LQ_REDUCE]["layers"]))
        assert [(int(a), int(b)) for a, b in pairs] == want, (where, cells[5], k)
        by_choice = re.search(r"\(\+(\d+)\)", cells[5])
        assert (int(by_choice.group(1)) if by_choice else 0) == k[O.LQ_RECIPE].get("by_choice", 0), (where, cells[5])
