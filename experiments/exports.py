"""An experiment's points as a file (``GET /api/experiments/{id}/download?format=``): one
row per stored point, by ordinal, with the run's id and kind.

- ``jsonl``: one JSON object per line, lists and objects as JSON;
- ``csv``: one header line, then one line per point; a list or object column (token ids,
  per-position KL, activations, ``data``) holds its JSON text;
- ``parquet``: one row group; lists of numbers are Parquet lists (``list<double>``,
  ``list<int64>``), the per-position activations and ``data`` JSON text (pyarrow).
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from experiments.models import ExperimentPoint, ExperimentRun

FORMATS = {
    "jsonl": "application/x-ndjson",
    "csv": "text/csv; charset=utf-8",
    "parquet": "application/vnd.apache.parquet",
}

# (column, Parquet type): "double", "int64", "bool", "string", "list<double>", "list<int64>", "json"
COLUMNS: tuple[tuple[str, str], ...] = (
    ("run_id", "string"),
    ("kind", "string"),
    ("ordinal", "int64"),
    ("prompt_index", "int64"),
    ("variant_index", "int64"),
    ("strength", "double"),
    ("is_default", "bool"),
    ("text", "string"),
    ("token_ids", "list<int64>"),
    ("finish_reason", "string"),
    ("kl_mean", "double"),
    ("kl_per_position", "list<double>"),
    ("target_before", "double"),
    ("target_after", "double"),
    ("target_before_per_position", "json"),
    ("target_after_per_position", "json"),
    ("loglik", "double"),
    ("loglik_per_token", "list<double>"),
    ("data", "json"),
)


def shown_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The run's spec as its routes show it (as validated and stored)."""
    return spec


def rows(run: ExperimentRun) -> list[dict[str, Any]]:
    """Every stored point of the run as one flat row (``COLUMNS``)."""
    out = []
    for point in ExperimentPoint.objects.filter(run=run).order_by("ordinal").iterator():
        row: dict[str, Any] = {"run_id": run.id, "kind": run.kind}
        for name, _ in COLUMNS[2:]:
            row[name] = getattr(point, name)
        out.append(row)
    return out


def to_jsonl(points: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in points).encode()


def to_csv(points: list[dict[str, Any]]) -> bytes:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([name for name, _ in COLUMNS])
    for row in points:
        line = []
        for name, kind in COLUMNS:
            value = row[name]
            if value is None:
                line.append("")
            elif kind.startswith("list") or kind == "json":
                line.append(json.dumps(value, ensure_ascii=False, allow_nan=False))
            elif kind == "bool":
                line.append("true" if value else "false")
            else:
                line.append(value)
        writer.writerow(line)
    return buffer.getvalue().encode()


def to_parquet(points: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {
        "string": pa.string(),
        "int64": pa.int64(),
        "double": pa.float64(),
        "bool": pa.bool_(),
        "list<int64>": pa.list_(pa.int64()),
        "list<double>": pa.list_(pa.float64()),
        "json": pa.string(),
    }
    arrays = []
    for name, kind in COLUMNS:
        values = [row[name] for row in points]
        if kind == "json":
            values = [None if v is None else json.dumps(v, ensure_ascii=False) for v in values]
        arrays.append(pa.array(values, type=types[kind]))
    table = pa.Table.from_arrays(arrays, names=[name for name, _ in COLUMNS])
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def export(run: ExperimentRun, fmt: str) -> tuple[bytes, str]:
    """The run's points in ``fmt`` (one of FORMATS) and the file's content type."""
    points = rows(run)
    body = {"jsonl": to_jsonl, "csv": to_csv, "parquet": to_parquet}[fmt](points)
    return body, FORMATS[fmt]
