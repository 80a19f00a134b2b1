"""Record result files made elsewhere (a GPU machine's $OUT) into the project's bench/results:
each JSON, with its CSV and PNG, is copied under its stable name (replacing that case's latest
result) and its run appended to history.csv.

    python bench/record.py /path/to/out/*.json [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as bc  # noqa: E402


def record(paths: list[Path], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for j in paths:
        try:
            meta = json.loads(j.read_text())
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or "benchmark" not in meta:
            raise SystemExit(f"{j}: not a result file written by bench/_common.write_results")
        for ext in (".json", ".csv", ".png", ".svg"):
            src = j.with_suffix(ext)
            if src.exists():
                shutil.copyfile(src, out / src.name)
        bc.append_history(out, bc.history_row(meta, j.stem))
        done.append(out / j.name)
    return done


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="result JSON files")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args(argv)
    for p in record(a.files, a.out):
        print("recorded", p)


if __name__ == "__main__":
    main()
