"""The learning margins the tests recorded (tests/helpers.py clears, $RL_MARGINS), as a table.

    python scripts/margins.py MARGINS.jsonl                    # one run's: .ci/run's summary
    python scripts/margins.py --cells DIR                      # scripts/check_robustness.sh's matrix, cell by cell

A margin is how far a result is past its bar (value - bar; for a ceiling such as an ablation's, bar - value):
negative is a failure, marked '!'."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def bar_text(r: dict) -> str:
    return ("<= " if r["at_most"] else ">= ") + format(r["bar"], "g")


def cell_text(r: dict | None) -> str:
    if r is None:
        return f"{'-':>21}"
    return f"{r['value']:>9.3f} ({r['margin']:+.3f}){'!' if r['margin'] < 0 else ' '}"


def one_run(path: Path) -> None:
    rows = read(path)
    print(f"{'learning result':<52}{'value':>9}{'bar':>10}{'margin':>9}")
    for r in rows:
        mark = " !" if r["margin"] < 0 else ""
        print(f"{r['name']:<52}{r['value']:>9.3f}{bar_text(r):>10}{r['margin']:>+9.3f}{mark}")
    if not rows:
        print("(no margins recorded)")


def cells(out: Path) -> None:
    """Every cell's margins side by side; robustness.json gets them all with each cell's exit status and time."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.cell.json"))]
    table: dict[str, dict[str, dict]] = {}
    for c in runs:
        c["margins"] = read(out / f"{c['cell']}.margins.jsonl")
        for r in c["margins"]:
            table.setdefault(r["name"], {})[c["cell"]] = r
    names = [c["cell"] for c in runs]
    print(f"\n== learning margins in {out}: value (margin), '!' below the bar ==")
    print(f"{'learning result':<52}{'bar':>10}" + "".join(f"{n:>21}" for n in names))
    for name, by_cell in table.items():
        bar = bar_text(next(iter(by_cell.values())))
        print(f"{name:<52}{bar:>10}" + "".join(cell_text(by_cell.get(n)) for n in names))
    print(f"{'cell exit status':<62}" + "".join(f"{c['exit']:>21}" for c in runs))
    print(f"{'cell minutes':<62}" + "".join(f"{c['seconds'] / 60:>21.1f}" for c in runs))
    (out / "robustness.json").write_text(json.dumps(runs, indent=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a margins jsonl, or with --cells the matrix's directory")
    ap.add_argument("--cells", action="store_true")
    a = ap.parse_args()
    cells(a.path) if a.cells else one_run(a.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
