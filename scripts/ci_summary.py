"""What a test run recorded, as tables: each pytest session's tiers and time ($RL_TIERS, tests/conftest.py), every
learning margin (tests/helpers.py clears, $RL_MARGINS) and every skip with its reason ($RL_SKIPS).

    python scripts/ci_summary.py --tiers T.jsonl --skips S.jsonl MARGINS.jsonl   # .ci/run's summary
    python scripts/ci_summary.py --cells DIR            # scripts/check_robustness.sh's matrix, cell by cell

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


def tiers(path: Path) -> None:
    """One row per pytest session: its tiers (and lane, marks), outcome counts, exit status and minutes."""
    print(f"{'pytest session':<44}{'passed':>8}{'failed':>8}{'skipped':>8}{'exit':>6}{'minutes':>9}")
    for r in read(path):
        name = "+".join(r["tiers"]) + (f" ({r['lane']} lane)" if r["lane"] else "")
        name += f" -m '{r['marks']}'" if r["marks"] else ""
        counts = "".join(f"{r['counts'].get(k, 0):>8}" for k in ("passed", "failed", "skipped"))
        print(f"{name:<44}{counts}{r['exit']:>6}{r['seconds'] / 60:>9.1f}")


def skips(path: Path) -> None:
    """Every skip, grouped by reason: how many, and the first test of each."""
    by_reason: dict[str, list[str]] = {}
    for r in read(path):
        by_reason.setdefault(r["reason"], []).append(r["test"])
    print(f"{sum(map(len, by_reason.values()))} skipped" + (":" if by_reason else ""))
    for reason, tests in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(tests):>4} x {reason}  (e.g. {tests[0]})")


def margins(path: Path) -> None:
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
    ap.add_argument("--tiers", type=Path, help="the sessions' jsonl ($RL_TIERS)")
    ap.add_argument("--skips", type=Path, help="the skips' jsonl ($RL_SKIPS)")
    a = ap.parse_args()
    if a.cells:
        cells(a.path)
        return 0
    for title, show, path in (
        ("tiers", tiers, a.tiers),
        ("learning margins", margins, a.path),
        ("skips", skips, a.skips),
    ):
        if path is not None:
            print(f"\n-- {title} --")
            show(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
