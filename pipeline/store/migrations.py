"""The store's numbered migrations, applied in order and recorded in ``_velox_migrations``.

Each ``@migration`` function appends itself to ``MIGRATIONS``; the list is append
only (a store records the names it applied, and a migration's number is its
place in the list). ``migrate`` applies the ones a store has not recorded yet,
each in one transaction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from .base import now

if TYPE_CHECKING:  # the writer imports sqlite_utils when it opens a store (it loads pandas if installed)
    import sqlite_utils

MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = []  # append only: stores record what they applied


def migration(function: Callable[[sqlite_utils.Database], None]) -> Callable[[sqlite_utils.Database], None]:
    """Register ``function`` as the next migration."""
    MIGRATIONS.append(function)
    return function


@migration
def m001_tables(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "id": int,
            "job_name": str,
            "spec_path": str,
            "spec": str,
            "spec_hash": str,
            "model": str,
            "velox_version": str,
            "mlx_version": str,
            "mlx_lm_version": str,
            "device": str,
            "host": str,
            "started_at": str,
            "ended_at": str,
            "status": str,
            "documents_total": int,
            "documents_done": int,
            "documents_skipped": int,
            "documents_failed": int,
            "documents_unchanged": int,
        },
        pk="id",
    )
    db["documents"].create(
        {
            "id": int,
            "doc_key": str,
            "run_id": int,
            "document_id": str,
            "content_hash": str,
            "settings_hash": str,
            "variant": str,
            "method": str,
            "budget": int,
            "scoring": str,
            "status": str,
            "error": str,
            "output": str,
            "prompt_tokens": int,
            "truncated": int,
            "output_tokens": int,
            "prefill_seconds": float,
            "decode_seconds": float,
            "prefill_tokens_per_second": float,
            "decode_tokens_per_second": float,
            "peak_memory_bytes": int,
            "stop_reason": str,
            "kept_bytes": int,
            "full_seq_bytes": int,
            "compression_ratio": float,
            "rouge_l_vs_full": float,
            "created_at": str,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["documents"].create_index(["doc_key"], unique=True)
    db["documents"].create_index(["document_id", "content_hash", "settings_hash"])
    db["layer_stats"].create(
        {
            "id": int,
            "document_row": int,
            "run_id": int,
            "document_id": str,
            "variant": str,
            "method": str,
            "layer": int,
            "layer_budget": int,
            "tokens_seen": int,
            "tokens_kept": int,
            "kept_bytes": int,
            "full_seq_bytes": int,
            "compression_ratio": float,
            "concentration": float,
        },
        pk="id",
        foreign_keys=[("document_row", "documents", "id"), ("run_id", "runs", "id")],
    )
    db["layer_stats"].create_index(["document_row"])
    db["documents"].enable_fts(["output", "document_id", "variant"], create_triggers=True)


@migration
def m002_views(db: sqlite_utils.Database) -> None:
    db.create_view(
        "run_summary",
        """
        select r.id as run_id, r.job_name, r.started_at, r.ended_at, r.status,
               r.documents_done, r.documents_skipped, r.documents_failed, r.documents_unchanged,
               count(d.id) as rows_written,
               round(avg(d.prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(d.decode_tokens_per_second), 1) as mean_decode_tps,
               round(sum(d.prefill_seconds + d.decode_seconds), 1) as generation_seconds
        from runs r left join documents d on d.run_id = r.id and d.status = 'done'
        group by r.id order by r.id desc
        """,
    )
    db.create_view(
        "method_summary",
        """
        select method, variant, budget, count(*) as documents,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(rouge_l_vs_full), 3) as mean_rouge_l_vs_full,
               round(avg(prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(decode_tokens_per_second), 1) as mean_decode_tps,
               round(avg(peak_memory_bytes) / 1048576.0, 1) as mean_peak_mib
        from documents where status = 'done'
        group by method, variant, budget order by method, budget
        """,
    )
    db.create_view(
        "layer_summary",
        """
        select method, variant, layer, count(*) as documents,
               round(avg(layer_budget), 1) as mean_budget,
               round(avg(tokens_kept), 1) as mean_tokens_kept,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(concentration), 3) as mean_concentration
        from layer_stats group by method, variant, layer order by method, variant, layer
        """,
    )


@migration
def m003_latest_rows(db: sqlite_utils.Database) -> None:
    """Mark each document × variant's latest row; views read only those; runs get an error column."""
    db["documents"].add_column("prompt_hash", str)
    db["documents"].add_column("is_latest", int, not_null_default=1)
    db["runs"].add_column("error", str)
    db.execute(
        "update documents set is_latest = 0 where id not in "
        "(select max(id) from documents group by document_id, variant)"
    )
    db["documents"].create_index(["document_id", "variant", "is_latest"])
    db["documents"].create_index(["document_id", "prompt_hash", "settings_hash"])
    db.create_view("latest_documents", "select * from documents where is_latest = 1")
    db.create_view(
        "run_summary",
        """
        select r.id as run_id, r.job_name, r.started_at, r.ended_at, r.status,
               r.documents_done, r.documents_skipped, r.documents_failed, r.documents_unchanged,
               count(d.id) as rows_written,
               round(avg(d.prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(d.decode_tokens_per_second), 1) as mean_decode_tps,
               round(sum(d.prefill_seconds + d.decode_seconds), 1) as generation_seconds,
               r.error
        from runs r left join documents d on d.run_id = r.id and d.status = 'done'
        group by r.id order by r.id desc
        """,
        replace=True,
    )
    db.create_view(
        "method_summary",
        """
        select method, variant, budget, count(*) as documents,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(rouge_l_vs_full), 3) as mean_rouge_l_vs_full,
               round(avg(prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(decode_tokens_per_second), 1) as mean_decode_tps,
               round(avg(peak_memory_bytes) / 1048576.0, 1) as mean_peak_mib
        from documents where status = 'done' and is_latest = 1
        group by method, variant, budget order by method, budget
        """,
        replace=True,
    )
    db.create_view(
        "layer_summary",
        """
        select l.method, l.variant, l.layer, count(*) as documents,
               round(avg(l.layer_budget), 1) as mean_budget,
               round(avg(l.tokens_kept), 1) as mean_tokens_kept,
               round(avg(l.compression_ratio), 2) as mean_compression_ratio,
               round(avg(l.concentration), 3) as mean_concentration
        from layer_stats l join documents d on d.id = l.document_row and d.is_latest = 1
        group by l.method, l.variant, l.layer order by l.method, l.variant, l.layer
        """,
        replace=True,
    )


@migration
def m004_fidelity(db: sqlite_utils.Database) -> None:
    """Teacher-forced fidelity to the full cache per compressed row; the full row's tokens to force."""
    documents = db["documents"]
    documents.add_column("agreement_vs_full", float)
    documents.add_column("nll_gap_vs_full", float)
    documents.add_column("fidelity_seconds", float)
    documents.add_column("output_token_ids", str)  # JSON list: what teacher forcing feeds
    documents.add_column("output_logprobs", str)  # JSON list: each output token's log-probability
    db.create_view(
        "run_summary",
        """
        select r.id as run_id, r.job_name, r.started_at, r.ended_at, r.status,
               r.documents_done, r.documents_skipped, r.documents_failed, r.documents_unchanged,
               count(d.id) as rows_written,
               round(avg(d.prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(d.decode_tokens_per_second), 1) as mean_decode_tps,
               round(sum(d.prefill_seconds + d.decode_seconds), 1) as generation_seconds,
               round(avg(d.agreement_vs_full), 3) as mean_agreement_vs_full,
               round(avg(d.nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               r.error
        from runs r left join documents d on d.run_id = r.id and d.status = 'done'
        group by r.id order by r.id desc
        """,
        replace=True,
    )
    db.create_view(
        "method_summary",
        """
        select method, variant, budget, count(*) as documents,
               round(avg(compression_ratio), 2) as mean_compression_ratio,
               round(avg(agreement_vs_full), 3) as mean_agreement_vs_full,
               round(min(agreement_vs_full), 3) as worst_agreement_vs_full,
               round(avg(nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               round(avg(rouge_l_vs_full), 3) as mean_rouge_l_vs_full,
               round(avg(prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(decode_tokens_per_second), 1) as mean_decode_tps,
               round(avg(peak_memory_bytes) / 1048576.0, 1) as mean_peak_mib
        from documents where status = 'done' and is_latest = 1
        group by method, variant, budget order by method, budget
        """,
        replace=True,
    )


@migration
def m005_run_engine(db: sqlite_utils.Database) -> None:
    """Where each run's documents ran: ``engine`` (in-process or ray), ``workers``, ``address`` (ray's)."""
    db["runs"].add_column("engine", str)
    db["runs"].add_column("workers", int)
    db["runs"].add_column("address", str)
    db.execute("update runs set engine = 'in-process', workers = 1")


@migration
def m006_layer_cache_kind(db: sqlite_utils.Database) -> None:
    """Which cache each layer had (``PyramidKVCache``, ``RotatingKVCache``, ...) and how it scored tokens."""
    db["layer_stats"].add_column("cache_kind", str)
    db["layer_stats"].add_column("scoring", str)


@migration
def m007_decode_batch_size(db: sqlite_utils.Database) -> None:
    """How many sequences each document x variant decoded beside (itself included; 1: alone)."""
    db["documents"].add_column("decode_batch_size", int)


@migration
def m008_fidelity_note(db: sqlite_utils.Database) -> None:
    """Why a compressed row that was done has no teacher-forced fidelity (its reference failed, is missing, ...)."""
    db["documents"].add_column("fidelity_note", str)


@migration
def m009_reading_seconds(db: sqlite_utils.Database) -> None:
    """The seconds of the reading a row's variant shared with the document's other variants (null: its own)."""
    db["documents"].add_column("reading_seconds", float)


@migration
def m010_eviction(db: sqlite_utils.Database) -> None:
    """When a compressed row's variant evicted (``prefill_end``, ``streaming``, ...; null: its policy's default).

    An ``eviction: auto`` variant reads at ``prefill_end`` where the prompt fits the context, by streaming where not.
    """
    db["documents"].add_column("eviction", str)


@migration
def m011_frontier(db: sqlite_utils.Database) -> None:
    """The compression frontier: each compressed variant's policy at every ``frontier.budgets`` budget, per document.

    One row per full-variant row (``doc_key``) x variant x budget, from the document's shared reading;
    ``frontier_summary``: per variant and budget, documents, the share of all their prompts' bytes kept and the
    mean per document, mean and worst agreement, mean NLL gap and ratio.
    """
    db["frontier"].create(
        {
            "id": int,
            "run_id": int,
            "doc_key": str,  # the full variant's row it was measured with (replaced with it)
            "document_id": str,
            "prompt_hash": str,
            "settings_hash": str,
            "variant": str,
            "method": str,
            "budget": str,
            "prompt_tokens": int,
            "kept_share": float,
            "kept_bytes": int,
            "full_seq_bytes": int,
            "compression_ratio": float,
            "agreement_vs_full": float,
            "nll_gap_vs_full": float,
            "seconds": float,  # cutting its stack, and its share of the batched teacher forcing
            "created_at": str,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["frontier"].create_index(["doc_key"])
    db.create_view(
        "frontier_summary",
        """
        select variant, method, budget, count(*) as documents,
               round(sum(kept_bytes) * 1.0 / sum(full_seq_bytes), 4) as kept_share,
               round(avg(kept_share), 4) as mean_kept_share,
               round(avg(agreement_vs_full), 3) as mean_agreement_vs_full,
               round(min(agreement_vs_full), 3) as worst_agreement_vs_full,
               round(avg(nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               round(avg(compression_ratio), 2) as mean_compression_ratio
        from frontier group by variant, method, budget order by variant, kept_share
        """,
    )


@migration
def m012_spare_bytes(db: sqlite_utils.Database) -> None:
    """Buffer room allocated ahead and holding no token (a full cache's growth steps), apart from ``kept_bytes``.

    ``kept_bytes`` counts the held tokens only from here on, so a full cache's ratio is 1.0.
    """
    db["documents"].add_column("spare_bytes", int)
    db["layer_stats"].add_column("spare_bytes", int)



ACCOUNTING = "prefill_end"  # what new rows' byte columns measure: see m013_figures_that_mean_one_thing


@migration
def m013_figures_that_mean_one_thing(db: sqlite_utils.Database) -> None:
    """Every figure means one thing, alone or shared (docs/store.md, "What each figure means").

    - ``documents.draft_seconds``: drafting a look-ahead's tokens, apart from ``prefill_seconds`` (which is now
      the reading, the look-ahead's call and the cut, whether the variant read alone or shared a reading;
      ``reading_seconds`` is the shared part). ``run_summary.generation_seconds`` counts a shared reading once.
    - ``accounting`` on ``documents``, ``layer_stats`` and ``frontier``: what the byte columns measure.
      ``prefill_end`` (from here on): the held tokens when prefill ended, the same for frontier points;
      ``decode_end``: held tokens after decoding (rows stored from m012 until here);
      ``spare_counted``: before m012, when ``kept_bytes`` also counted buffer room. The views average
      byte figures over ``prefill_end`` rows only.
    - ``frontier``: keyed by what produced a row (``frontier_key``: document, prompt, settings, the variant's
      settings and the budget), ``status`` (``done``; ``skipped`` where the variant cannot be cut from one
      reading; ``error``, measured again next run) with a ``note``, and ``is_latest`` per document x variant
      x budget. Rows from before carry no key: they are kept as history (``is_latest = 0``) and the next run
      measures every point again.
    """
    documents, layers, frontier = db["documents"], db["layer_stats"], db["frontier"]
    documents.add_column("draft_seconds", float)
    for table in (documents, layers, frontier):
        table.add_column("accounting", str)
    db.execute("update documents set accounting = case when spare_bytes is null then 'spare_counted' "
               "else 'decode_end' end where status = 'done'")
    db.execute("update layer_stats set accounting = case when spare_bytes is null then 'spare_counted' "
               "else 'decode_end' end")
    frontier.add_column("frontier_key", str)
    frontier.add_column("status", str)
    frontier.add_column("note", str)
    frontier.add_column("is_latest", int, not_null_default=0)
    applied = db.execute("select applied_at from _velox_migrations where name = 'm012_spare_bytes'").fetchone()
    db.execute(
        "update frontier set status = 'done', accounting = case when created_at >= ? then 'decode_end' "
        "else 'spare_counted' end",
        [applied[0] if applied else ""],
    )
    frontier.create_index(["frontier_key"])
    frontier.create_index(["document_id", "variant", "budget", "is_latest"])
    db.create_view(
        "run_summary",
        """
        select r.id as run_id, r.job_name, r.started_at, r.ended_at, r.status,
               r.documents_done, r.documents_skipped, r.documents_failed, r.documents_unchanged,
               count(d.id) as rows_written,
               round(avg(d.prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(d.decode_tokens_per_second), 1) as mean_decode_tps,
               round(sum(d.prefill_seconds - coalesce(d.reading_seconds, 0) + d.decode_seconds
                         + case when d.reading_seconds is null then coalesce(d.draft_seconds, 0) else 0 end)
                     + coalesce((select sum(shared) from (
                           select max(s.reading_seconds) + coalesce(max(s.draft_seconds), 0) as shared
                           from documents s where s.run_id = r.id and s.status = 'done'
                           and s.reading_seconds is not null group by s.document_id, s.prompt_hash)), 0), 1)
                     as generation_seconds,
               round(avg(d.agreement_vs_full), 3) as mean_agreement_vs_full,
               round(avg(d.nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               r.error
        from runs r left join documents d on d.run_id = r.id and d.status = 'done'
        group by r.id order by r.id desc
        """,
        replace=True,
    )
    db.create_view(
        "method_summary",
        f"""
        select method, variant, budget, count(*) as documents,
               round(avg(case when accounting = '{ACCOUNTING}' then compression_ratio end), 2)
                     as mean_compression_ratio,
               round(avg(agreement_vs_full), 3) as mean_agreement_vs_full,
               round(min(agreement_vs_full), 3) as worst_agreement_vs_full,
               round(avg(nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               round(avg(rouge_l_vs_full), 3) as mean_rouge_l_vs_full,
               round(avg(prefill_tokens_per_second), 1) as mean_prefill_tps,
               round(avg(decode_tokens_per_second), 1) as mean_decode_tps,
               round(avg(draft_seconds), 2) as mean_draft_seconds,
               round(avg(peak_memory_bytes) / 1048576.0, 1) as mean_peak_mib
        from documents where status = 'done' and is_latest = 1
        group by method, variant, budget order by method, budget
        """,
        replace=True,
    )
    db.create_view(
        "layer_summary",
        f"""
        select l.method, l.variant, l.layer, count(*) as documents,
               round(avg(l.layer_budget), 1) as mean_budget,
               round(avg(l.tokens_kept), 1) as mean_tokens_kept,
               round(avg(case when l.accounting = '{ACCOUNTING}' then l.compression_ratio end), 2)
                     as mean_compression_ratio,
               round(avg(l.concentration), 3) as mean_concentration
        from layer_stats l join documents d on d.id = l.document_row and d.is_latest = 1
        group by l.method, l.variant, l.layer order by l.method, l.variant, l.layer
        """,
        replace=True,
    )
    db.create_view(
        "frontier_summary",
        f"""
        select r.job_name, f.variant, f.method, f.budget, count(*) as documents,
               round(sum(f.kept_bytes) * 1.0 / sum(f.full_seq_bytes), 4) as kept_share,
               round(avg(f.kept_share), 4) as mean_kept_share,
               round(avg(f.agreement_vs_full), 3) as mean_agreement_vs_full,
               round(min(f.agreement_vs_full), 3) as worst_agreement_vs_full,
               round(avg(f.nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               round(avg(f.compression_ratio), 2) as mean_compression_ratio
        from frontier f join runs r on r.id = f.run_id
        where f.is_latest = 1 and f.status = 'done' and f.accounting = '{ACCOUNTING}'
        group by r.job_name, f.variant, f.method, f.budget order by r.job_name, f.variant, kept_share
        """,
        replace=True,
    )


@migration
def m014_kv_bits(db: sqlite_utils.Database) -> None:
    """The bits each held key and value code took once decoding started (``kv_bits``; null: held in float)."""
    db["documents"].add_column("kv_bits", int)


@migration
def m015_frontier_bits(db: sqlite_utils.Database) -> None:
    """The frontier's ``kv_bits`` axis (``frontier.bits``): each point's bits (null: float), one summary row per
    variant x budget x bits."""
    db["frontier"].add_column("kv_bits", int)
    db.create_view(
        "frontier_summary",
        f"""
        select r.job_name, f.variant, f.method, f.budget, f.kv_bits, count(*) as documents,
               round(sum(f.kept_bytes) * 1.0 / sum(f.full_seq_bytes), 4) as kept_share,
               round(avg(f.kept_share), 4) as mean_kept_share,
               round(avg(f.agreement_vs_full), 3) as mean_agreement_vs_full,
               round(min(f.agreement_vs_full), 3) as worst_agreement_vs_full,
               round(avg(f.nll_gap_vs_full), 3) as mean_nll_gap_vs_full,
               round(avg(f.compression_ratio), 2) as mean_compression_ratio
        from frontier f join runs r on r.id = f.run_id
        where f.is_latest = 1 and f.status = 'done' and f.accounting = '{ACCOUNTING}'
        group by r.job_name, f.variant, f.method, f.budget, f.kv_bits
        order by r.job_name, f.variant, f.kv_bits, kept_share
        """,
        replace=True,
    )


def migrate(db: sqlite_utils.Database, *, transaction: Optional[Callable] = None) -> list[str]:
    """Apply the migrations not yet recorded, each in one transaction; returns the names applied.

    A migration interrupted at any point (even by kill -9) leaves no trace, so the
    next start applies it again from the beginning. ``transaction`` is a context
    manager factory for one write transaction (default ``db.atomic``).
    """
    transaction = transaction or db.atomic
    with transaction():
        db["_velox_migrations"].create({"id": int, "name": str, "applied_at": str}, pk="id", if_not_exists=True)
    done = {row["name"] for row in db["_velox_migrations"].rows}
    applied = []
    for number, step in enumerate(MIGRATIONS, 1):
        if step.__name__ in done:
            continue
        with transaction():
            step(db)
            db["_velox_migrations"].insert({"id": number, "name": step.__name__, "applied_at": now()})
        applied.append(step.__name__)
    return applied

