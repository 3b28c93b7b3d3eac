"""The Ray engine on two local workers: nothing lost, nothing doubled, the in-process outputs.

One Ray session serves the whole module (starting Ray takes seconds); the run under
test uses it as it is. Workers load the tiny model through ``load_model`` hooks defined
here, which Ray imports by name in each worker process.
"""

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip(
    "ray", reason="the ray engine needs the velox[ray] extra: pip install -e '.[ray]' (make test installs it)"
)

import pipeline.execute  # noqa: E402
from pipeline.model_store import load_model  # noqa: E402
from pipeline.platform import blas_threads  # noqa: E402
from pipeline.engines.ray_engine import connect  # noqa: E402
from pipeline.runner import run_job  # noqa: E402
from pipeline.spec import EngineSpec, load_spec  # noqa: E402
from tests.pipeline.helpers import REPO, rows, wait_until_stored, write_corpus  # noqa: E402

WORKERS = 2
OUTPUT_COLUMNS = (
    "document_id, variant, status, output, prompt_tokens, truncated, output_tokens, stop_reason, "
    "kept_bytes, full_seq_bytes, compression_ratio, rouge_l_vs_full, agreement_vs_full, "
    "output_token_ids, output_logprobs"
)
# Ray workers run one BLAS thread each, the in-process run as many as the machine has: sums of
# products round in another order, so the NLL gap (a mean of unrounded log-probabilities) may
# differ in its seventh digit; it is compared within this tolerance, everything else exactly.
NLL_GAP_TOLERANCE = 1e-5
LAYER_COLUMNS = "document_id, variant, layer, layer_budget, tokens_seen, tokens_kept, kept_bytes, concentration"


@pytest.fixture(scope="module")
def ray_session():
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        address, started = connect(EngineSpec(name="ray", workers=WORKERS))
        assert started and address == "local"
        yield
        ray.shutdown()


def ray_run(path, *, load=load_model, **engine):
    spec = load_spec(path)
    spec.engine = EngineSpec(name="ray", workers=WORKERS, **engine)
    return run_job(spec, quiet=True, load_model=load)


def logged_load(marks: str, name: str, **options):
    """Load the model in a worker and log every variant it runs there; some prompts kill the worker.

    A prompt with ``CRASHONCE`` kills its worker in its second variant the first time
    (mid-document: the full cache's output is made but never returned); one with
    ``POISON`` does so every time.
    """
    model, tokenizer = load_model(name, **options)
    prefill = pipeline.execute.prefill_variant

    def logging_prefill(model, tokenizer, prompt_tokens, config, settings, **options):
        text = tokenizer.decode(prompt_tokens)
        document = next(word for word in text.split() if word.startswith("doc-"))
        Path(marks, f"{document} {config.method} {os.getpid()} {blas_threads()} {time.monotonic_ns()}").touch()
        if config.method != "full":
            if "POISON" in text:
                os.kill(os.getpid(), signal.SIGKILL)
            if "CRASHONCE" in text and not Path(marks, "crashed").exists():
                Path(marks, "crashed").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return prefill(model, tokenizer, prompt_tokens, config, settings, **options)

    pipeline.execute.prefill_variant = logging_prefill  # this worker process only
    # each variant reads on its own (no shared reading), so that a death can come between variants
    pipeline.execute.SharedReadings.sharing = staticmethod(lambda item: [])
    return model, tokenizer


def executions(marks: Path) -> list[tuple[str, str, int, str]]:
    """``(document, method, pid, BLAS threads)`` per variant a worker started."""
    found = [path.name.split() for path in marks.iterdir() if path.name != "crashed"]
    return [(document, method, int(pid), threads) for document, method, pid, threads, _ in found]


def test_outputs_equal_the_in_process_engine_and_every_key_is_stored_once(job, tmp_path, ray_session):
    write_corpus(tmp_path / "corpus.parquet", n=6)
    in_process = run_job(load_spec(job({"output": {"db": str(tmp_path / "in_process.db")}})), quiet=True)
    assert in_process.exit_status == 0
    path = job()
    summary = ray_run(path)
    assert summary.exit_status == 0 and summary.counts["documents_done"] == 18
    db, reference = tmp_path / "store.db", tmp_path / "in_process.db"
    assert rows(db, "select count(*), count(distinct doc_key) from documents") == [(18, 18)]
    for columns, table in ((OUTPUT_COLUMNS, "documents"), (LAYER_COLUMNS, "layer_stats")):
        query = f"select {columns} from {table} order by {columns}"
        assert rows(db, query) == rows(reference, query)
    gaps = "select document_id, variant, nll_gap_vs_full from documents order by 1, 2"
    for (doc, variant, gap), (_, _, expected) in zip(rows(db, gaps), rows(reference, gaps), strict=True):
        assert (gap is None) == (expected is None), (doc, variant)
        assert gap is None or gap == pytest.approx(expected, abs=NLL_GAP_TOLERANCE), (doc, variant)
    assert rows(db, "select doc_key from documents order by 1") == rows(reference, "select doc_key from documents order by 1")
    [(engine, workers, address)] = rows(db, "select engine, workers, address from runs")
    assert (engine, workers) == ("ray", WORKERS) and address  # the session the run used
    assert rows(reference, "select engine, workers, address from runs") == [("in-process", 1, None)]
    again = ray_run(path)  # a rerun finds everything done before dispatching anything
    assert again.counts == {"documents_done": 0, "documents_skipped": 0, "documents_failed": 0, "documents_unchanged": 18}
    assert rows(db, "select count(*) from documents") == [(18,)]


@pytest.mark.parametrize("batch", [1, 4])
def test_a_worker_killed_mid_document_is_replaced_and_nothing_is_lost_or_doubled(job, tmp_path, ray_session, batch):
    """With groups, the group a death takes is run again document by document: only the poison fails."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = ["doc-0", "doc-1", "doc-2", "doc-3", "doc-4"]
    texts = [f"{i} is about caches. " + extra for i, extra in zip(ids, ["", "CRASHONCE", "", "POISON", ""])]
    pq.write_table(pa.table({"id": ids, "text": texts, "topic": ["t"] * 5}), tmp_path / "corpus.parquet")
    marks = tmp_path / "marks"
    marks.mkdir()
    path = job({"generation": {"decode_batch_size": batch}})
    summary = ray_run(path, load=functools.partial(logged_load, str(marks)), max_retries=1)
    db = tmp_path / "store.db"
    assert summary.exit_status == 1  # the poison document failed; the run went on
    assert rows(db, "select count(*), count(distinct doc_key) from documents") == [(15, 15)]
    statuses = rows(db, "select document_id, status, count(*) from documents group by document_id, status")
    assert statuses == [("doc-0", "done", 3), ("doc-1", "done", 3), ("doc-2", "done", 3), ("doc-3", "error", 3), ("doc-4", "done", 3)]
    [(error,)] = rows(db, "select distinct error from documents where document_id = 'doc-3'")
    assert "worker died on each of 2 tries" in error
    assert rows(db, "select count(*) from layer_stats") == [(12 * 4,)]
    assert rows(db, "select status, documents_done, documents_failed from runs") == [("done_with_errors", 12, 3)]
    if batch > 1:
        return  # which variants ran how often depends on how Ray cut the groups
    ran = executions(marks)
    started = {(doc, method): sum(1 for d, m, _, _ in ran if (d, m) == (doc, method)) for doc, method, _, _ in ran}
    for document in ("doc-0", "doc-2", "doc-4"):  # untouched by the deaths: each variant ran once
        assert [started[(document, m)] for m in ("full", "pyramidkv", "squeeze")] == [1, 1, 1]
    assert started[("doc-1", "full")] == 2  # killed in its second variant, then redone on a fresh worker
    assert started[("doc-3", "full")] == 2 and ("doc-3", "squeeze") not in started  # 1 + max_retries tries
    crash_pids = [pid for doc, method, pid, _ in ran if (doc, method) == ("doc-1", "full")]
    assert len(set(crash_pids)) == 2
    if blas_threads() is not None:  # OpenBLAS preloaded here, so in the workers too: one thread each
        assert {threads for *_, threads in ran} == {"1"}


def test_a_killed_driver_leaves_a_store_the_next_run_completes(job, tmp_path, ray_session):
    write_corpus(tmp_path / "corpus.parquet", n=16)
    path = job({"generation": {"max_tokens": 24}})
    db = tmp_path / "store.db"
    address = ray.get_runtime_context().gcs_address  # the driver joins this module's Ray, as on a cluster
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(path), "-q", "--engine", "ray", "--address", address],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_until_stored(driver, db, 3, timeout=180)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    stored = rows(db, "select count(*) from documents")[0][0]
    assert 3 <= stored < 48
    assert rows(db, "select count(*) from layer_stats") == [(stored * 4,)]  # whole documents or nothing
    resumed = ray_run(path)
    assert resumed.exit_status == 0
    assert rows(db, "select count(*), count(distinct doc_key) from documents") == [(48, 48)]
    assert rows(db, "select count(*) from documents where status != 'done'") == [(0,)]
    assert rows(db, "select count(*) from layer_stats") == [(48 * 4,)]
    assert rows(db, "select id, status, engine from runs order by id") == [(1, "interrupted", "ray"), (2, "done", "ray")]
    assert rows(db, "select documents_unchanged, documents_done from runs where id = 2") == [(stored, 48 - stored)]

