"""Code-size figures for house-keeping: lines per layer and the longest functions.

`python -m bench.codesize [src/vchan_assets]` prints the line count of each layer
and the ten longest functions (by line span, decorators excluded). Not part of `make bench`:
it measures the code, not the system.
"""

from __future__ import annotations

import ast
import signal
import sys
from pathlib import Path

LAYERS = {  # the import layers, bottom up (pyproject.toml [tool.importlinter])
    "model": ["model.py"],
    "meta": ["meta"],
    "storage": ["storage"],
    "spark": ["spark"],
    "deploy, stack": ["deploy", "stack.py"],
    "datacoord": ["datacoord"],
    "wal": ["wal"],
    "datanode": ["datanode"],
    "lifecycle": ["lifecycle"],
    "imports": ["imports"],
    "indexes": ["indexes"],
    "query": ["query"],
    "catalog, status, metrics": ["catalog_tables.py", "catalog.py", "status.py", "metrics.py"],
    "defs": ["defs"],
    "demo": ["demo"],
    "cli": ["cli"],
    "testing": ["testing"],
}


def layer_files(root: Path, parts: list[str]) -> list[Path]:
    files: list[Path] = []
    for part in parts:
        path = root / part
        if path.is_dir():
            files += sorted(path.rglob("*.py"))
        elif path.exists():
            files.append(path)
    return files


def line_count(files: list[Path]) -> int:
    return sum(len(f.read_text().splitlines()) for f in files)


def longest_functions(root: Path, most: int = 10) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((span, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)[:most]


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "src/vchan_assets")
    counted: set[Path] = set()
    for layer, parts in LAYERS.items():
        files = layer_files(root, parts)
        counted.update(files)
        print(f"{layer:28} {line_count(files):6}")
    rest = [f for f in root.rglob("*.py") if f not in counted]
    print(f"{'other':28} {line_count(rest):6}  ({', '.join(sorted(str(f.relative_to(root)) for f in rest))})")
    print(f"{'total':28} {line_count(list(root.rglob('*.py'))):6}")
    print("\nlongest functions (lines):")
    for span, where in longest_functions(root):
        print(f"{span:5}  {where}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the report quietly
    main()
