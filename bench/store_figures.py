"""Do the store's figures mean the same alone and shared? The main job's variants run both ways, as a user runs them.

For the first ``--documents`` topics of the main job that fit the model's context, writes
them to a Parquet file of their own, then runs ``velox-batch run`` on a copy of
``jobs/summarize.yaml`` without its frontier: once with every variant (they share one
reading per topic) and once per variant alone (``--variant``), each into a fresh store.
Prints, per variant, the summed ``prefill_seconds``, ``draft_seconds`` (where the store
has the column) and mean ``peak_memory_bytes`` of both ways with their ratio, the worst
document's peak ratio, and how many outputs are identical. ``--repo`` runs another
checkout's ``velox-batch`` (e.g. a worktree of older code) on the same topics.
``--repeats N`` runs every way N times, in turn, and keeps each document's least
seconds (the machine's noise is ±10-20% from one run to the next). Not a test:
nothing here asserts on time.

    python bench/store_figures.py --documents 24
    python bench/store_figures.py --documents 24 --repeats 2 --repo /tmp/old-velox
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.model_store import context_length, load_model  # noqa: E402
from pipeline.prompting import PromptTooLong, build_prompt  # noqa: E402
from pipeline.source import iter_documents, open_dataset  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402

MAIN_JOB = ROOT / "jobs" / "summarize.yaml"


def fitting_topics(spec, count: int, path: Path) -> int:
    """Write the first ``count`` documents of ``spec`` whose prompt fits the context to ``path``; returns how many."""
    model, tokenizer = load_model(spec.model)
    context = context_length(model)
    kept = []
    for document in iter_documents(spec, open_dataset(spec)):
        if len(kept) == count:
            break
        try:
            build_prompt(spec, tokenizer, document, context_length=context)
        except PromptTooLong:
            continue
        kept.append(document)
    pq.write_table(pa.table({"topic": [d.document_id for d in kept], "text": [d.fields["text"] for d in kept]}), path)
    return len(kept)


def run(repo: Path, spec_path: Path, *variants: str) -> float:
    """``velox-batch run`` in ``repo`` (its own code), quietly; returns the wall seconds."""
    command = [sys.executable, "-m", "pipeline.platform", "-m", "pipeline.cli", "run", str(spec_path), "-q"]
    for variant in variants:
        command += ["--variant", variant]
    start = time.perf_counter()
    subprocess.run(command, cwd=repo, check=True, env={**os.environ, "PYTHONPATH": str(repo)})
    return time.perf_counter() - start


def figures(db: Path) -> dict:
    """Per (document, variant) of a store: prefill seconds, draft seconds (or None), peak bytes, output."""
    with sqlite3.connect(db) as conn:
        columns = {row[1] for row in conn.execute("pragma table_info(documents)")}
        draft = "draft_seconds" if "draft_seconds" in columns else "null"
        found = conn.execute(
            f"select document_id, variant, prefill_seconds, {draft}, peak_memory_bytes, output "
            "from documents where status = 'done'"
        ).fetchall()
    return {(document, variant): rest for document, variant, *rest in found}


def least_seconds(kept: dict, found: dict) -> dict:
    """``found``'s figures, each document's prefill and draft seconds the least of ``kept``'s and its own."""
    merged = {}
    for key, (prefill, draft, peak, output) in found.items():
        if key in kept:
            prefill, draft = min(prefill, kept[key][0]), min(draft or 0, kept[key][1] or 0) if draft is not None else None
        merged[key] = (prefill, draft, peak, output)
    return merged


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--job", type=Path, default=MAIN_JOB)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose velox-batch runs the jobs")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every way; each document's least seconds")
    args = parser.parse_args(argv)
    spec = load_spec(str(args.job))
    raw = yaml.safe_load(args.job.read_text())
    names = [variant["name"] for variant in raw["variants"]]
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        count = fitting_topics(spec, args.documents, folder / "topics.parquet")
        raw.pop("frontier", None)
        raw["input"] = {**raw["input"], "path": str(folder / "topics.parquet"), "id_column": "topic",
                        "text_column": "text"}
        ways = {"shared": names, **{name: [name] for name in names}}
        stored, walls = {}, {}
        for repeat in range(args.repeats):
            for way, variants in ways.items():
                raw["output"] = {"db": str(folder / f"{way}-{repeat}.db")}
                spec_path = folder / f"{way}.yaml"
                spec_path.write_text(yaml.safe_dump(raw))
                wall = run(args.repo, spec_path, *([] if way == "shared" else variants))
                walls[way] = min(walls.get(way, wall), wall)
                stored[way] = least_seconds(stored.get(way, {}), figures(folder / f"{way}-{repeat}.db"))
                print(f"# {way}, run {repeat + 1}: {wall:.1f} s", flush=True)
    shared = stored["shared"]
    print(f"\n{count} topics of {args.job.name} that fit, no frontier; code: {args.repo}; "
          f"least of {args.repeats} run(s) per document\n")
    print("| variant | prefill s alone | shared | shared / alone | draft s alone | shared | "
          "peak MiB alone | shared | shared / alone | worst document | identical outputs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        alone = {key: value for key, value in stored[name].items() if key[1] == name}
        keys = sorted(key for key in alone if key in shared)
        if not keys:
            continue
        seconds = [sum(table[key][0] for key in keys) for table in (alone, shared)]
        drafts = [sum(table[key][1] or 0 for key in keys) for table in (alone, shared)]
        peaks = [sum(table[key][2] for key in keys) / len(keys) / 2**20 for table in (alone, shared)]
        worst = max((shared[key][2] / alone[key][2] for key in keys), key=lambda ratio: abs(ratio - 1))
        same = sum(alone[key][3] == shared[key][3] for key in keys)
        print(f"| {name} | {seconds[0]:.1f} | {seconds[1]:.1f} | {seconds[1] / seconds[0]:.2f} | {drafts[0]:.1f} | "
              f"{drafts[1]:.1f} | {peaks[0]:.0f} | {peaks[1]:.0f} | {peaks[1] / peaks[0]:.2f} | {worst:.2f} | "
              f"{same} of {len(keys)} |")
    print("\nwall seconds (model load included): " + ", ".join(f"{way} {wall:.1f}" for way, wall in walls.items()))


if __name__ == "__main__":
    main()
