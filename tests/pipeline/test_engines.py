"""Engine settings, the plan / execute / persist seams, and the run row's engine columns (no Ray needed)."""

import dataclasses
import re
import socket
import sqlite3
import sys
import threading

import pytest

import pipeline.execute
import pipeline.schedule
from pipeline.execute import Executor, execute, execute_group
from pipeline.model_store import load_tokenizer
from pipeline.plan import WorkItem
from pipeline.runner import run_job
from pipeline.spec import GenerationSpec, SpecError, load_spec, parse_spec
from pipeline.store import MIGRATIONS, Store
from tests.pipeline.helpers import invoke, rows


def spec_with_engine(engine):
    raw = {"name": "t", "model": "m", "input": {"path": "x.parquet", "id_column": "id", "text_column": "text"}}
    return parse_spec({**raw, "engine": engine})


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"name": "spark"}, "engine.name: 'spark' is not one of in-process, ray"),
        ({"name": "ray", "workers": 0}, "engine.workers: must be at least 1"),
        ({"name": "ray", "max_retries": -1}, "engine.max_retries: must be at least 0"),
        ({"name": "ray", "cpus_per_worker": 0}, "engine.cpus_per_worker: must be at least 1"),
        ({"name": "ray", "address": " "}, "engine.address: must not be empty"),
        ({"workers": 2}, "engine.workers: only the ray engine has workers"),
        ({"name": "ray", "worker": 2}, "engine.worker: unknown field (did you mean 'workers'?)"),
    ],
)
def test_engine_settings_are_validated_by_field(engine, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        spec_with_engine(engine)


def test_engine_options_override_the_spec(job):
    assert invoke("run", job(), "--workers", "2").output.strip() == (
        "Error: --workers: only the ray engine has workers (add --engine ray)"
    )
    # --engine in-process drops the spec's ray settings rather than refusing them
    result = invoke("run", job(engine={"name": "ray", "workers": 3}), "--engine", "in-process", "-q")
    assert result.exit_code == 0, result.output


def test_asking_for_ray_without_it_says_what_to_install(job, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: importing it fails
    monkeypatch.delitem(sys.modules, "pipeline.engines.ray_engine", raising=False)
    result = invoke("run", job(), "--engine", "ray")
    assert result.exit_code == 2
    assert "engine.name: 'ray' needs Ray" in result.output and "pip install 'velox[ray]'" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "store.db").exists()  # nothing was run


def test_the_run_row_records_the_in_process_engine(job, tmp_path):
    assert invoke("run", job(), "-q").exit_code == 0
    assert rows(tmp_path / "store.db", "select engine, workers, address from runs") == [("in-process", 1, None)]


def test_runs_from_before_the_engine_columns_are_marked_in_process(tmp_path, monkeypatch):
    import pipeline.store.migrations as migrations_module

    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS[:3])
    with Store(tmp_path / "old.db").locked() as store:
        store.start_run({"job_name": "old"})
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    with Store(tmp_path / "old.db").locked():
        pass
    assert rows(tmp_path / "old.db", "select engine, workers, address from runs") == [("in-process", 1, None)]


@pytest.fixture
def work_item(job, tiny_model_dir):
    spec = load_spec(job())
    tokenizer, _ = load_tokenizer(str(tiny_model_dir))
    return WorkItem(0, "doc-0", list(tokenizer.encode("About caches: a short document.")), spec.variants, GenerationSpec(max_tokens=5))


def test_a_variant_that_raises_is_an_outcome_and_the_others_still_run(tiny_model, work_item, monkeypatch):
    prefill = pipeline.execute.prefill_variant

    def fails_for_pyramid(model, tokenizer, prompt_tokens, config, settings, **options):
        if config.method == "pyramidkv":
            raise ValueError("no room")
        return prefill(model, tokenizer, prompt_tokens, config, settings, **options)

    monkeypatch.setattr(pipeline.execute, "prefill_variant", fails_for_pyramid)
    monkeypatch.setattr(pipeline.execute.SharedReadings, "sharing", staticmethod(lambda item: []))  # each its own
    outcomes = execute(*tiny_model, work_item)
    assert [(o.variant, o.error) for o in outcomes] == [("full", None), ("pyramid", "ValueError: no room"), ("squeeze", None)]
    assert all(o.result is not None for o in outcomes if o.error is None)


def test_a_shared_reading_that_raises_fails_the_variants_that_shared_it_and_no_other(tiny_model, job, tiny_model_dir,
                                                                                     monkeypatch):
    spec = load_spec(job({"variants": [
        {"name": "full", "method": "full"},
        {"name": "pyramid", "method": "pyramidkv", "budget": 24},
        {"name": "streamed", "method": "pyramidkv", "budget": 24, "eviction": "streaming"},
    ]}))
    tokenizer, _ = load_tokenizer(str(tiny_model_dir))
    item = WorkItem(0, "doc-0", list(tokenizer.encode("About caches: a short document.")), spec.variants,
                    GenerationSpec(max_tokens=5))
    assert [v.name for v in pipeline.execute.SharedReadings.sharing(item)] == ["full", "pyramid"]

    def no_reading(*args, **kwargs):
        raise MemoryError("no room to read")

    monkeypatch.setattr(pipeline.execute, "read_shared", no_reading)
    outcomes = execute(*tiny_model, item)
    assert [(o.variant, o.error) for o in outcomes] == [
        ("full", "MemoryError: no room to read"), ("pyramid", "MemoryError: no room to read"), ("streamed", None)
    ]


def test_an_executor_loads_its_model_in_the_thread_that_calls_it(tiny_model, tiny_model_dir, work_item):
    """Ray calls a worker from another thread than its constructor; MLX streams are per thread."""
    executor = Executor(str(tiny_model_dir), "float32")  # made here, used only in another thread
    found = []
    thread = threading.Thread(target=lambda: found.extend(executor(work_item)))
    thread.start()
    thread.join()
    expected = execute(*tiny_model, work_item)
    assert [(o.variant, o.error, o.result.output, o.result.layer_stats) for o in found] == [
        (o.variant, None, o.result.output, o.result.layer_stats) for o in expected
    ]


def test_a_driver_tokenizer_builds_the_same_prompts_as_the_loaded_model(tiny_model, tiny_model_dir):
    tokenizer, context = load_tokenizer(str(tiny_model_dir))
    model, loaded = tiny_model
    text = "About caches: doc-0 <|im_end|> and more"
    assert tokenizer.encode(text) == loaded.encode(text) and tokenizer.eos_token_ids == loaded.eos_token_ids
    assert context == 4096


def test_spec_engine_settings_reach_the_run(job, tmp_path):
    """The same job with engine settings for in-process runs unchanged: engine is not part of any key."""
    first = run_job(load_spec(job()), quiet=True)
    second = run_job(load_spec(job(engine={"name": "in-process"})), quiet=True)
    assert (first.counts["documents_done"], second.counts["documents_unchanged"]) == (12, 12)
    with sqlite3.connect(tmp_path / "store.db") as conn:
        assert conn.execute("select count(*) from runs where engine = 'in-process'").fetchone() == (2,)


def test_fidelity_is_the_same_whether_the_full_output_is_made_alongside_or_read_from_the_store(job, tmp_path):
    together = tmp_path / "together.db"
    assert invoke("run", job({"output": {"db": str(together)}}), "-q").exit_code == 0
    assert invoke("run", job(), "-q", "--variant", "full").exit_code == 0  # the full outputs first ...
    assert invoke("run", job(), "-q").exit_code == 0  # ... then the compressed ones, teacher-forced on them
    query = "select document_id, variant, agreement_vs_full, nll_gap_vs_full from documents order by 1, 2"
    later = rows(tmp_path / "store.db", query)
    assert later == rows(together, query)
    assert all(agreement is not None for _, variant, agreement, _ in later if variant != "full")


def test_a_ray_address_where_nothing_answers_is_one_line_and_exit_2(job, tmp_path):
    ray = pytest.importorskip("ray", reason="the ray engine needs the velox[ray] extra")
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process; the run would use it")
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = invoke("run", job(), "--engine", "ray", "--address", f"127.0.0.1:{port}")
    assert result.exit_code == 2, result.output
    assert f"engine.address: nothing answers at 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output and not ray.is_initialized()
    assert rows(tmp_path / "store.db", "select status, engine from runs") == [("failed", "ray")]


def test_cluster_workers_get_the_drivers_blas_and_attention_settings(monkeypatch):
    ray_engine = pytest.importorskip("pipeline.engines.ray_engine", reason="the ray engine needs the velox[ray] extra")
    monkeypatch.setenv("LD_PRELOAD", "/lib/libblas.so.3")
    monkeypatch.setenv("VELOX_ATTENTION", "exact")
    monkeypatch.delenv("VELOX_ATTENTION_STREAMS", raising=False)
    env = ray_engine.worker_env(2)
    assert env["OPENBLAS_NUM_THREADS"] == "2" and env["LD_PRELOAD"] == "/lib/libblas.so.3"
    assert env["VELOX_ATTENTION"] == "exact" and "VELOX_ATTENTION_STREAMS" not in env


def test_ray_dispatches_the_most_work_first_and_keeps_input_order_on_ties(work_item):
    ray_engine = pytest.importorskip("pipeline.engines.ray_engine", reason="the ray engine needs the velox[ray] extra")
    short, long = work_item.prompt_tokens[:2], work_item.prompt_tokens * 3
    items = [
        dataclasses.replace(work_item, index=0, prompt_tokens=short),
        dataclasses.replace(work_item, index=1, prompt_tokens=long),
        dataclasses.replace(work_item, index=2, prompt_tokens=short),
        dataclasses.replace(work_item, index=3, prompt_tokens=long, variants=work_item.variants[:1]),
    ]
    assert [item.index for item in ray_engine.longest_first(items)] == [1, 3, 0, 2]


@pytest.mark.parametrize("held_mb, batches", [(1, [3, 3, 3]), (2, [2, 2, 1]), (6, [1, 1, 1])])
def test_a_group_decodes_together_while_its_caches_fit_the_memory_budget(tiny_model, work_item, held_mb, batches, monkeypatch):
    # the tiny model's caches hold kilobytes: each decoding row counts as holding held_mb MiB instead; the
    # third row joins once the first two have left (they all stop at max_tokens, at once)
    monkeypatch.setattr(pipeline.schedule, "batch_footprint", lambda rows: len(rows) * held_mb * 2**20)
    settings = GenerationSpec(max_tokens=5, decode_batch_size=4, decode_batch_memory_mb=4)
    items = [
        dataclasses.replace(work_item, index=i, prompt_tokens=work_item.prompt_tokens[: 20 + 5 * i], generation=settings)
        for i in range(3)
    ]
    grouped = execute_group(*tiny_model, items)
    alone = [execute(*tiny_model, dataclasses.replace(item, generation=GenerationSpec(max_tokens=5))) for item in items]
    for outcomes, expected, batch in zip(grouped, alone, batches):
        assert [(o.variant, o.result.token_ids, o.result.layer_stats) for o in outcomes] == [
            (o.variant, o.result.token_ids, o.result.layer_stats) for o in expected]
        assert {o.result.decode_batch_size for o in outcomes} == {batch}


def test_in_process_groups_take_similar_lengths_together_and_every_item_once(work_item):
    from pipeline.engines.in_process import LOOKAHEAD_GROUPS, groups

    settings = GenerationSpec(max_tokens=5, decode_batch_size=2)
    lengths = [3, 9, 1, 7, 5, 8, 2, 6, 4, 10]  # 8 items fill one window of LOOKAHEAD_GROUPS groups of 2
    assert LOOKAHEAD_GROUPS == 4
    items = [dataclasses.replace(work_item, index=i, prompt_tokens=[1] * n, generation=settings) for i, n in enumerate(lengths)]
    found = [[len(item.prompt_tokens) for item in group] for group in groups(iter(items))]
    assert found == [[9, 8], [7, 6], [5, 3], [2, 1], [10, 4]]


def test_a_group_teacher_forces_every_item_even_when_its_first_item_has_no_full_variant_due(tiny_model, work_item):
    settings = GenerationSpec(max_tokens=5, decode_batch_size=4)
    no_full = dataclasses.replace(work_item, index=0, variants=work_item.variants[1:], generation=settings)
    with_full = dataclasses.replace(work_item, index=1, generation=settings)
    first, second = execute_group(*tiny_model, [no_full, with_full])
    assert all(o.result.fidelity is None for o in first)  # no reference: its full output is not here
    assert [o.result.fidelity is not None for o in second] == [False, True, True]


def _items(job, tiny_model_dir, texts):
    spec = load_spec(job())
    tokenizer, _ = load_tokenizer(str(tiny_model_dir))
    return [
        WorkItem(i, f"doc-{i}", list(tokenizer.encode(f"About caches: {text}")), spec.variants, GenerationSpec(max_tokens=5))
        for i, text in enumerate(texts)
    ]


def test_one_bad_row_fails_alone_and_its_documents_say_why_they_have_no_fidelity(tiny_model, job, tiny_model_dir, monkeypatch):
    from tests.pipeline import poison

    texts = ["a short document.", f"a {poison.MARK}ed document.", "another document, a little longer."]
    clean = execute_group(*tiny_model, _items(job, tiny_model_dir, texts))
    poison.install(monkeypatch)
    outcomes = execute_group(*tiny_model, _items(job, tiny_model_dir, texts))
    for index in (0, 2):  # decoded beside the bad row, they are what they are without it
        for got, expected in zip(outcomes[index], clean[index], strict=True):
            assert got.error is None and got.result.token_ids == expected.result.token_ids
            assert got.fidelity_note is None
            if got.variant != "full":
                assert got.result.fidelity.agreement == expected.result.fidelity.agreement
                assert got.result.fidelity.nll_gap == pytest.approx(expected.result.fidelity.nll_gap, abs=1e-5)
    bad = {o.variant: o for o in outcomes[1]}
    assert bad["full"].error == "RuntimeError: injected: a poisoned row"
    for name in ("pyramid", "squeeze"):
        assert bad[name].error is None and bad[name].result.fidelity is None
        assert bad[name].fidelity_note == "the full variant failed: RuntimeError: injected: a poisoned row"
