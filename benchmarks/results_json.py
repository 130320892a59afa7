"""Results as JSON that reads well and stays small: objects indented by level, but any object or
list whose compact form fits on one line (``WIDTH`` characters) written on that line -- a
timeline's rows, a round's ratios.  The same values as ``json.dumps(doc, indent=1)`` at about half
its bytes (the results travel with every device call, whose transfer holds 64 MiB in all).

    python3 benchmarks/results_json.py benchmarks/results/*.json   # rewrite files in place
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WIDTH = 120


def dumps(doc, indent: int = 0) -> str:
    """``doc`` as JSON text (see the module's docstring)."""
    flat = json.dumps(doc, separators=(", ", ": "))
    if not isinstance(doc, (dict, list)) or len(flat) + indent <= WIDTH or not doc:
        return flat
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(doc, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in doc.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if all(not isinstance(v, (dict, list)) for v in doc):  # scalars: as many a line as fit
        lines, line = [], ""
        for v in doc:
            s = json.dumps(v)
            if line and len(inner) + len(line) + len(s) + 2 > WIDTH:
                lines.append(line.rstrip())
                line = ""
            line += s + ", "
        lines.append(line[:-2])
        return "[\n" + ",\n".join(inner + ln.rstrip(",") for ln in lines) + "\n" + pad + "]"
    return "[\n" + ",\n".join(inner + dumps(v, indent + 1) for v in doc) + "\n" + pad + "]"


def write(path: str | Path, doc) -> None:
    """Write ``doc`` to ``path`` (see the module's docstring)."""
    Path(path).write_text(dumps(doc) + "\n")


def main(paths: list[str]) -> int:
    for p in paths:
        doc = json.loads(Path(p).read_text())
        write(p, doc)
        assert json.loads(Path(p).read_text()) == doc, p
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
