"""The main job on float32 and on quantized weights: the same outputs? And what each costs.

For the first ``--documents`` topics of the main job that fit the model's context (as
``bench/store_figures.py`` picks them), runs ``velox-batch run`` on a copy of
``jobs/summarize.yaml`` without its frontier, every variant sharing its reading, once
per weights mode (``VELOX_WEIGHTS``), each into a fresh store, one after the other.
Prints per variant how many outputs are identical, the summed prefill and decode
seconds, and the stored peak memory per document (mean and most). Issue 43 asks for
identical greedy outputs and a peak that falls by the weights' difference. Not a test:
nothing here asserts on time.

    python -m pipeline.platform bench/weights_outputs.py --documents 24
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.store_figures import MAIN_JOB, ROOT, fitting_topics, run  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402


def stored(db: Path) -> dict:
    """Per (document, variant): output, prefill seconds, decode seconds, peak bytes."""
    with sqlite3.connect(db) as conn:
        found = conn.execute("select document_id, variant, output, prefill_seconds, decode_seconds, peak_memory_bytes "
                             "from documents where status = 'done'").fetchall()
    return {(document, variant): rest for document, variant, *rest in found}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--job", type=Path, default=MAIN_JOB)
    parser.add_argument("--weights", nargs=2, default=["float32", "quantized"], metavar="MODE")
    args = parser.parse_args(argv)
    raw = yaml.safe_load(args.job.read_text())
    raw.pop("frontier", None)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        count = fitting_topics(load_spec(str(args.job)), args.documents, folder / "topics.parquet")
        raw["input"] = {**raw["input"], "path": str(folder / "topics.parquet"), "id_column": "topic",
                        "text_column": "text"}
        results = {}
        for mode in args.weights:
            raw["output"] = {"db": str(folder / f"{mode}.db")}
            spec_path = folder / f"{mode}.yaml"
            spec_path.write_text(yaml.safe_dump(raw))
            os.environ["VELOX_WEIGHTS"] = mode
            wall = run(ROOT, spec_path)
            results[mode] = stored(folder / f"{mode}.db")
            print(f"# {mode}: {wall:.1f} s for {count} topics", flush=True)
    first, second = (results[mode] for mode in args.weights)
    print(f"| variant | identical outputs | prefill s {args.weights[0]} | {args.weights[1]} | decode s {args.weights[0]} "
          f"| {args.weights[1]} | peak MiB mean / most {args.weights[0]} | {args.weights[1]} |")
    print("|---|---|---|---|---|---|---|---|")
    for variant in sorted({variant for _, variant in first}):
        keys = sorted(key for key in first if key[1] == variant and key in second)
        same = sum(first[key][0] == second[key][0] for key in keys)
        sums = [[sum(table[key][i] for key in keys) for i in (1, 2)] for table in (first, second)]
        peaks = [(sum(table[key][3] for key in keys) / len(keys) / 2**20, max(table[key][3] for key in keys) / 2**20)
                 for table in (first, second)]
        print(f"| {variant} | {same}/{len(keys)} | {sums[0][0]:.1f} | {sums[1][0]:.1f} | {sums[0][1]:.1f} | {sums[1][1]:.1f} "
              f"| {peaks[0][0]:.0f} / {peaks[0][1]:.0f} | {peaks[1][0]:.0f} / {peaks[1][1]:.0f} |")


if __name__ == "__main__":
    main()
