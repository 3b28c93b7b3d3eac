"""``velox-batch``: a thin Click layer over the pipeline's Python API."""

from __future__ import annotations

import csv
import functools
import json
import sys

import click

from . import model_store


@click.group()
@click.version_option(package_name="velox")
def cli():
    """Velox batch jobs: KV-cache-compressed LLM runs with a queryable SQLite store.

    \b
    Example:
        velox-batch run jobs/summarize.yaml
    """


@cli.group()
def models():
    """Import and list models (GGUF files become mlx-lm model directories).

    \b
    Example:
        velox-batch models import
        velox-batch models list
    """


@models.command("import")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
def models_import(path):
    """Import a GGUF file (default: the embedded SmolLM2) into the model cache.

    Idempotent: a model imported before is reused.

    \b
    Example:
        velox-batch models import ~/Downloads/model.Q4_1.gguf
    """
    try:
        directory = model_store.import_model(path)
    except model_store.ModelImportError as exc:
        raise click.ClickException(str(exc))
    click.echo(str(directory))


@models.command("list")
def models_list():
    """List imported models, their directories and sizes.

    \b
    Example:
        velox-batch models list
    """
    found = model_store.list_models()
    if not found:
        click.echo(f"no models imported in {model_store.models_dir()}")
    for model in found:
        click.echo(f"{model.name}\t{model.size_bytes / 2**20:.1f} MiB\t{model.path}")


@cli.command()
def doctor():
    """Show MLX version and device, BLAS and its measured GEMM speed, and the model cache.

    \b
    Example:
        velox-batch doctor
    """
    from .doctor import diagnose

    report = diagnose()
    width = max(len(name) for name, _ in report.facts)
    for name, value in report.facts:
        click.echo(f"{name:<{width}}  {value}")
    for line in report.advice:
        click.echo(f"! {line}")


EXIT_STATUS_HELP = """
\b
Exit status:
  0  every document done (or skipped by the limits, or unchanged since a run before)
  1  at least one document failed; its error is stored and the run went on
  2  invalid job spec, input file, column, store path (--db) or model, or the ray engine
     is not installed or not reachable at its address; nothing was run
  3  another run holds the store; nothing was run
  4  the run stopped on an unexpected error (printed); the run is marked failed
  130, 143  Ctrl-C (SIGINT) or SIGTERM: the document in progress is abandoned, the run
     is marked interrupted and the lock released; the next run resumes
"""


@cli.command(epilog=EXIT_STATUS_HELP)
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False))
@click.option("--db", help="SQLite store to write (overrides output.db).")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many documents (overrides limits.max_documents).")
@click.option("--variant", "variant_names", multiple=True, help="Run only this variant (repeatable).")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), help="Overrides limits.max_prompt_tokens.")
@click.option("--on-too-long", type=click.Choice(["truncate", "skip", "fail"]), help="Overrides limits.on_too_long.")
@click.option("--model", help="Model alias, mlx-lm directory or .gguf file (overrides model).")
@click.option(
    "--engine", type=click.Choice(["in-process", "ray"]), help="Where documents run (overrides engine.name; ray needs velox[ray])."
)
@click.option("--workers", type=click.IntRange(min=1), help="Ray workers (overrides engine.workers; default: every CPU).")
@click.option("--address", help="Join this Ray cluster (overrides engine.address and $RAY_ADDRESS).")
@click.option("--force", is_flag=True, help="Redo documents already done with the same content and settings.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
def run(spec_path, db, limit, variant_names, max_prompt_tokens, on_too_long, model, engine, workers, address, force, quiet):
    """Run a job spec: every document of its Parquet input through every cache variant.

    Results go to the SQLite store named by output.db. Documents already done
    with the same content and settings are skipped, so a nightly rerun only
    does new work and a killed run resumes where it stopped.

    \b
    Example:
        velox-batch run jobs/summarize.yaml
        velox-batch run jobs/summarize.yaml --limit 5 --variant full --db /tmp/try.db
        velox-batch run jobs/summarize.yaml --engine ray --workers 2
    """
    from .runner import EXIT_CRASHED, JobError, run_job
    from .spec import SpecError, load_spec

    try:
        spec = load_spec(spec_path).with_overrides(
            db=db, limit=limit, variants=variant_names, max_prompt_tokens=max_prompt_tokens,
            on_too_long=on_too_long, model=model, engine=engine, workers=workers, address=address,
        )
        summary = run_job(spec, force=force, quiet=quiet)
    except SpecError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    except JobError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(exc.exit_status)
    except Exception as exc:  # the run is marked failed; show where it broke
        import traceback

        traceback.print_exc()
        click.echo(f"Error: the run stopped on an unexpected error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_CRASHED)
    counts = ", ".join(f"{k.removeprefix('documents_')} {v}" for k, v in summary.counts.items())
    if summary.status == "interrupted":
        message = f"run {summary.run_id} interrupted by {summary.signal_name}; the next run resumes it ({counts})"
        click.echo(message, err=True)
    elif not quiet:
        click.echo(f"run {summary.run_id} -> {summary.db}: {counts}", err=True)
    sys.exit(summary.exit_status)


def _db_option(function):
    from .store import DEFAULT_DB

    return click.option(
        "--db", default=DEFAULT_DB, show_default=True, type=click.Path(dir_okay=False), help="SQLite store."
    )(function)


@cli.command()
@_db_option
@click.option("--limit", default=10, show_default=True, help="How many runs.")
def status(db, limit):
    """Show recent runs: status, document counts and mean speeds.

    \b
    Example:
        velox-batch status --db data/velox.db
    """
    from .store import recent_runs

    columns, rows = _read_or_fail(recent_runs, db, limit)
    _print_table(columns, rows)


@cli.command()
@click.argument("sql")
@_db_option
@click.option("--format", "output_format", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
def query(sql, db, output_format):
    """Run a read-only SQL query against the store.

    \b
    Example:
        velox-batch query "select method, mean_compression_ratio from method_summary"
        velox-batch query "select document_id from documents_fts where documents_fts match 'tuple'" --format json
    """
    from .store import read_only_query

    columns, rows = _read_or_fail(read_only_query, db, sql)
    if output_format == "json":
        click.echo(json.dumps([dict(zip(columns, row)) for row in rows], indent=2, default=str))
    elif output_format == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        _print_table(columns, rows)


@cli.command()
@click.argument("document_id")
@_db_option
def show(document_id, db):
    """Show one document's outputs (every variant) and its per-layer accounting.

    \b
    Example:
        velox-batch show tuples --db data/velox.db
    """
    from .store import document_layers, document_variants

    columns, rows = _read_or_fail(document_variants, db, document_id)
    if not rows:
        raise click.ClickException(f"no document '{document_id}' in {db}")
    for row in rows:
        record = dict(zip(columns, row))
        click.echo(f"== {document_id} / {record['variant']}: {record['status']}")
        for name in ("error", "prompt_tokens", "output_tokens", "compression_ratio", "agreement_vs_full",
                     "nll_gap_vs_full", "rouge_l_vs_full"):
            if record.get(name) is not None:
                click.echo(f"{name}: {record[name]}")
        if record["output"] is not None:
            click.echo(f"output:\n{record['output']}")
        layer_columns, layer_rows = _read_or_fail(document_layers, db, record["id"])
        if layer_rows:
            _print_table(layer_columns, layer_rows)
        click.echo()


@cli.group()
def corpus():
    """Write ready-made corpora to Parquet.

    \b
    Example:
        velox-batch corpus pydoc-topics data/pydoc_topics.parquet
    """


@corpus.command("pydoc-topics")
@click.argument("path", type=click.Path(dir_okay=False), default="data/pydoc_topics.parquet")
def corpus_pydoc_topics(path):
    """CPython's reference-manual topics (pydoc_data.topics): columns topic, text.

    \b
    Example:
        velox-batch corpus pydoc-topics data/pydoc_topics.parquet
    """
    from .source import write_pydoc_topics

    rows = write_pydoc_topics(path)
    click.echo(f"{rows} documents -> {path}")


@cli.command()
@_db_option
@click.option("--run", "run_id", type=int, help="Run id (default: the newest run that stored documents).")
@click.option(
    "-o", "--output", default="report.html", show_default=True, type=click.Path(dir_okay=False), help="HTML file to write."
)
def report(db, run_id, output):
    """Write one self-contained HTML page of a run: per-layer budgets, bytes kept,
    fidelity, speed, trends across runs, failed and skipped documents.

    \b
    Example:
        velox-batch report --db data/velox.db -o report.html
    """
    from .report import ReportError, write_report

    try:
        result = _read_or_fail(lambda path: write_report(path, output, run_id=run_id), db)
    except ReportError as exc:
        raise click.ClickException(str(exc))
    for message in result.messages:
        click.echo(f"note: {message}", err=True)
    shown = f"run {result.run_id}" if result.run_id is not None else "no run"
    click.echo(f"{shown} -> {output} ({len(result.charts)} charts)", err=True)


def _read_or_fail(reader, db, *args):
    import sqlite3

    try:
        _note_read_only(db)
        return reader(db, *args)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc))
    except sqlite3.Error as exc:
        raise click.ClickException(f"query failed: {exc}")


@functools.lru_cache(maxsize=None)
def _note_read_only(db):
    from .store import read_only_note

    note = read_only_note(db)
    if note:
        click.echo(f"note: {note}", err=True)


def _print_table(columns, rows):
    if not columns:
        return
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [min(60, max([len(c)] + [len(r[i]) for r in cells])) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    click.echo("  ".join("-" * w for w in widths))
    for row in cells:
        click.echo("  ".join(_cut(v.replace("\n", " "), w).ljust(w) for v, w in zip(row, widths)))


def _cut(text, width):
    return text if len(text) <= width else text[: width - 1] + "…"


def _named_command(args):
    """The command that a command line names (``cli`` itself when none), found without running it."""
    command = cli
    for arg in args:
        if not isinstance(command, click.Group):
            break
        if not arg.startswith("-"):  # the groups take no options with values
            command = command.commands.get(arg)
            if command is None:
                return None
    return command


def main():
    """Console-script entry point: run the CLI, with a fast BLAS preloaded for the commands that load MLX.

    Preloading re-executes the interpreter (``ensure_fast_blas``), so only ``run``,
    ``doctor`` and ``models import`` do it; ``--help`` and the readers (``status``,
    ``query``, ``show``, ``report``, ``models list``) start without MLX.
    """
    if _named_command(sys.argv[1:]) in (run, doctor, models_import):
        from .platform import ensure_fast_blas

        ensure_fast_blas()
    cli()


if __name__ == "__main__":
    main()
