"""The repository stands on its own: its code and docs name Milvus' components and this
project's own docs, never design documents a reader does not have ("the seed's
taskScheduler", "DESIGN §18", "../shared/...")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where the words are read: the package, the docs, the README and the benchmarks.
PLACES = ("src", "docs", "README.md", "BENCHMARKS.md", "bench")
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".sh"}

# Phrases that point at documents outside the repository. Random-number seeds ("the same
# seed gives the same faults", `seed: int`) match none of them.
FORBIDDEN = {
    "the seed": re.compile(r"\bthe seed\b", re.I),
    "seed's": re.compile(r"\bseed's\b", re.I),
    "Seed behaviour": re.compile(r"\bseed behaviou?r\b", re.I),
    "(seed: ...) / (seed `...`)": re.compile(r"\(seed(?::(?!\s*int\b)| `)"),
    "Seeds:": re.compile(r"\bSeeds?:"),
    "DESIGN §": re.compile(r"\bDESIGN\b"),
    "§": re.compile("§"),
    "lease MEP": re.compile(r"\blease MEP\b", re.I),
    "MEP 7 without Milvus": re.compile(r"(?<!Milvus' )\bMEP 7\b"),
    "../shared": re.compile(r"\.\./shared\b"),
    "issue N": re.compile(r"\bissue \d+\b", re.I),
}


def files() -> list[Path]:
    found: list[Path] = []
    for place in PLACES:
        path = ROOT / place
        if path.is_file():
            found.append(path)
        else:
            found.extend(p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES)
    return found


def offending_lines(text: str) -> list[tuple[int, str, str]]:
    return [
        (number, name, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        for name, pattern in FORBIDDEN.items()
        if pattern.search(line)
    ]


def test_the_phrases_are_found_where_they_are_written() -> None:
    """The patterns catch the forms the old words took, and leave random seeds alone."""
    old = [
        '"""The DataCoord\'s one task scheduler (the seed\'s taskScheduler) for the',
        "Seed behaviour: a DataNode registers its session in etcd",
        "A node's state in its session (seed: stateCode).",
        "(seed `updateBalanceConfigLoop`)",
        "not a new request (seed:",
        "## Switches of the seed",
        "upgraded. Seeds: the DataNode's `stateCode`",
        "exactly once into a sink with Spark's checkpoint (DESIGN §18).",
        "Channel leases (lease MEP): who may write",
        '"""Lease MEP, "DataCoord reloads from metastore periodically"',
        "Watching a prefix of etcd with revisions (MEP 7: a DataNode watches",
        "see ../shared/design.md",
        "Target (issue 29): <= 3 s median",
    ]
    assert [len(offending_lines(line)) > 0 for line in old] == [True] * len(old)
    random_seeds = [
        "def generate_rows(schema, n: int, start_pk: int = 0, seed: int = 0):",
        "the same seed gives the same faults and victims",
        'parser.add_argument("--seed", type=int, default=SEED, help="picks the schedule")',
        "rng = np.random.default_rng(seed)",
        "def _mix(x: np.ndarray, seed: int) -> np.ndarray:",
        "and seeded chaos schedules (kill -9, SIGSTOP, etcd restarts).",
    ]
    assert [offending_lines(line) for line in random_seeds] == [[]] * len(random_seeds)


def test_code_and_docs_name_milvus_and_this_project_not_outside_documents() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {name}: {line}"
        for path in files()
        for number, name, line in offending_lines(path.read_text(encoding="utf-8"))
    ]
    assert found == [], "words that point outside the repository:\n" + "\n".join(found)
