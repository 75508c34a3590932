"""Text trace files: one iteration time in seconds per line, plus a JSON label file per directory.

Real traces (for example recorded on a GPU machine) are added to the evaluation by dropping the
.txt files and their labels into a directory; the generator writes the same layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from greyhound.traces.labels import Trace

LABELS_FILE = "labels.json"


class TraceFormatError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


def parse_series(text: str, source: str = "<input>") -> npt.NDArray[np.float64]:
    """Parse one value per line; blank lines and '#' comments are skipped."""
    out: list[float] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            value = float(line)
        except ValueError:
            raise TraceFormatError(f"{source}:{lineno}: not a number: {line!r}") from None
        if not math.isfinite(value):
            raise TraceFormatError(f"{source}:{lineno}: not a finite number: {line!r}")
        if value < 0.0:
            raise TraceFormatError(f"{source}:{lineno}: negative iteration time: {value}")
        out.append(value)
    return np.asarray(out, dtype=np.float64)


def read_series(path: str | Path) -> npt.NDArray[np.float64]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceFormatError(f"{p}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{p}: cannot read: {exc}") from None
    return parse_series(text, str(p))


def write_traces(directory: str | Path, traces: Iterable[Trace]) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    labels = {}
    for t in traces:
        (d / f"{t.name}.txt").write_text("".join(f"{v:.9g}\n" for v in t.times.tolist()))
        labels[t.name] = t.labels_json()
    (d / LABELS_FILE).write_text(json.dumps(labels, indent=1, sort_keys=True))


def load_traces(directory: str | Path) -> list[Trace]:
    """Every labelled .txt in the directory (a trace missing from labels.json is healthy)."""
    d = Path(directory)
    label_path = d / LABELS_FILE
    labels = json.loads(label_path.read_text()) if label_path.exists() else {}
    out = []
    for path in sorted(d.glob("*.txt")):
        out.append(Trace.from_labels(path.stem, read_series(path), labels.get(path.stem, {})))
    return out
