"""Documents per hour: ``--engine ray --workers N`` against the in-process engine, same job, one run.

Runs a subset of the main job (``jobs/summarize.yaml``: the first ``--limit`` topics of
CPython's reference manual, prompts up to 400 tokens, the longer ones recorded as
skipped and not counted) once with each engine, each into its own fresh store, then
checks that both stored the same outputs. Two rates per engine:

* end to end: documents run / the whole ``run_job`` (model load, Ray start, shutdown);
* steady: documents after the first / the time from the first finished document to
  the last (what a long night's run approaches).

    python bench/engines.py                      # 24 topics, 2 workers
    python bench/engines.py --limit 79 --workers 2
    python bench/engines.py --limit 3 --variant full  # a smoke run

Run it alone on the machine: other processes on the same cores skew both engines.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.platform import ensure_fast_blas  # noqa: E402


class _Clock:
    """A progress stream (not a terminal: plain lines) that times each document that ran."""

    def __init__(self):
        self.finished: list[float] = []

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> None:
        if " done" in text:  # a document with at least one variant run (skipped ones finish at once)
            self.finished.append(time.perf_counter())

    def flush(self) -> None:
        pass


def run_engine(spec_path: str, db: Path, *, engine: str, workers: int, limit: int, variants: list[str]) -> dict:
    from pipeline.runner import run_job
    from pipeline.spec import EngineSpec, load_spec

    spec = load_spec(spec_path)
    spec.output.db = str(db)
    spec.limits.max_documents = limit
    if variants:
        spec.variants = [v for v in spec.variants if v.name in variants]
    spec.engine = EngineSpec(name=engine, workers=workers if engine == "ray" else None)
    clock = _Clock()
    start = time.perf_counter()
    summary = run_job(spec, progress_stream=clock)
    wall = time.perf_counter() - start
    documents = len(clock.finished)
    steady = clock.finished[-1] - clock.finished[0] if documents > 1 else float("nan")
    return {
        "engine": engine if engine == "in-process" else f"ray x{workers}",
        "documents": documents,
        "rows": summary.counts["documents_done"],
        "wall": wall,
        "per_hour": documents / wall * 3600,
        "steady_per_hour": (documents - 1) / steady * 3600 if documents > 1 else float("nan"),
    }


def stored_outputs(db: Path) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return conn.execute(
            "select document_id, variant, status, output, output_tokens from documents order by document_id, variant"
        ).fetchall()


def ensure_corpus(spec_path: str, directory: Path) -> str:
    """The spec, pointed at a fresh copy of the pydoc-topics corpus when its input is missing."""
    import yaml

    from pipeline.source import write_pydoc_topics

    raw = yaml.safe_load(Path(spec_path).read_text())
    if Path(raw["input"]["path"]).exists():
        return spec_path
    corpus = directory / "pydoc_topics.parquet"
    write_pydoc_topics(corpus)
    raw["input"]["path"] = str(corpus)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", default="jobs/summarize.yaml")
    parser.add_argument("--limit", type=int, default=24, help="the first N documents of the input")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--variant", action="append", default=[], help="only this variant (repeatable)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="velox-engines-") as tmp:
        tmp = Path(tmp)
        spec_path = ensure_corpus(args.spec, tmp)
        results = [
            run_engine(spec_path, tmp / f"{engine}.db", engine=engine, workers=args.workers, limit=args.limit,
                       variants=args.variant)
            for engine in ("in-process", "ray")
        ]
        same = stored_outputs(tmp / "in-process.db") == stored_outputs(tmp / "ray.db")
    base = results[0]
    print(f"first {args.limit} documents of {args.spec}; variants: {', '.join(args.variant) or 'all'}")
    print("| engine | documents run | rows done | wall s | docs/hour | vs in-process | steady docs/hour | vs in-process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['engine']} | {r['documents']} | {r['rows']} | {r['wall']:.1f} | {r['per_hour']:.0f} | "
            f"{r['per_hour'] / base['per_hour']:.2f} | {r['steady_per_hour']:.0f} | "
            f"{r['steady_per_hour'] / base['steady_per_hour']:.2f} |"
        )
    print(f"outputs equal: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    ensure_fast_blas()
    main()
