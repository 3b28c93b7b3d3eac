"""velox-batch with streaming variants: prompts split into prefix/document/instruction, no topic too long."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.prompting import PromptTooLong, _encode, build_prompt
from pipeline.source import Document
from pipeline.spec import parse_spec
from tests.pipeline.helpers import invoke, rows
from tests.tiny_model import build_tiny_model_dir


def _raw_spec(chat_template=True, system="Be brief.", template="About {topic}: {text}\nSummarize.", **input_changes):
    return {
        "name": "split",
        "model": "unused",
        "input": {"path": "unused.parquet", "id_column": "id", "text_column": "text", "prompt_template": template,
                  "system": system, "chat_template": chat_template, **input_changes},
    }


def _spec(*args, **changes):
    return parse_spec(_raw_spec(*args, **changes))


@pytest.mark.parametrize("chat_template", [True, False])
@pytest.mark.parametrize("system", ["Be brief.", None])
def test_the_prompt_splits_into_prefix_document_and_instruction(tiny_model, chat_template, system):
    _, tokenizer = tiny_model
    spec = _spec(chat_template=chat_template, system=system)
    text = "Caches keep a budget of tokens. They evict the rest."
    document = Document("d", {"text": text, "topic": "caches"}, "hash")
    prompt = build_prompt(spec, tokenizer, document)
    assert prompt.tokens == _encode(spec, tokenizer, f"About caches: {text}\nSummarize."), "tokens unchanged"
    assert prompt.prefix + prompt.document + prompt.instruction == prompt.tokens
    assert text in tokenizer.decode(prompt.document)
    assert tokenizer.decode(prompt.prefix).endswith("About caches: ")
    assert tokenizer.decode(prompt.instruction).startswith("\nSummarize.")
    if chat_template:
        assert tokenizer.decode(prompt.instruction).endswith("assistant\n")


def test_smollm2_tokens_are_split_on_token_boundaries(smollm2):
    _, tokenizer = smollm2
    spec = _spec(template="{text}\n\nSummarize the documentation above in two sentences.", system="Be concise.")
    text = "Lists are mutable sequences, typically used to store collections of homogeneous items."
    prompt = build_prompt(spec, tokenizer, Document("d", {"text": text}, "hash"))
    assert prompt.prefix + prompt.document + prompt.instruction == prompt.tokens
    assert tokenizer.decode(prompt.document).strip() == text
    assert "Summarize the documentation above" in tokenizer.decode(prompt.instruction)
    assert len(prompt.instruction) < 30


def test_a_ready_prompt_has_no_split(tiny_model):
    _, tokenizer = tiny_model
    spec = parse_spec({"name": "x", "model": "m", "input": {"path": "p", "id_column": "id", "prompt_column": "prompt"}})
    prompt = build_prompt(spec, tokenizer, Document("d", {"prompt": "Everything at once."}, "hash"))
    assert not prompt.has_split and prompt.document == prompt.tokens and prompt.instruction == []


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.integration
@pytest.mark.parametrize("chat_template", [True, False])
def test_a_document_past_the_tokenizers_maximum_length_encodes_without_its_warning(chat_template):
    """transformers warns once per tokenizer when a text encodes past ``model_max_length`` (SmolLM2's 8,192),
    which a streamed document does by design; the pipeline measures lengths itself: past the context a
    prompt is truncated to fit (the default) or refused loudly, naming its length (``on_too_long: skip``)."""
    from pipeline.model_store import load_tokenizer

    tokenizer, context = load_tokenizer("smollm2-135m-instruct")  # a fresh one: it has not warned yet
    assert tokenizer._tokenizer.model_max_length == 8192
    spec = _spec(chat_template)
    long_text = "Caches keep a budget of tokens and evict the rest. " * 1000  # ~11k tokens
    caught = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(caught)
    try:
        document = Document("long", {"text": long_text, "topic": "caches"}, "hash")
        streamed = build_prompt(spec, tokenizer, document)  # a streaming variant's: no context limit
        truncated = build_prompt(spec, tokenizer, document, context_length=context)
        skipping = parse_spec({**_raw_spec(chat_template), "limits": {"on_too_long": "skip"}})
        with pytest.raises(PromptTooLong, match=rf"prompt has {len(streamed.tokens)} tokens, more than .* context"):
            build_prompt(skipping, tokenizer, document, context_length=context)
    finally:
        logger.removeHandler(caught)
    assert len(streamed.tokens) > 8192 and truncated.truncated and len(truncated.tokens) <= context
    assert not [message for message in caught.messages if "sequence length is longer" in message], caught.messages


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory):
    directory = build_tiny_model_dir(tmp_path_factory.mktemp("short") / "llama")
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 160
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _short_and_long_corpus(tmp_path) -> None:
    """A document that fits a 160-position context and one that does not."""
    table = pa.table({
        "id": ["short", "long"],
        "text": ["A short note on caches.", "Long documents are read chunk by chunk in bounded memory. " * 8],
        "topic": ["caches", "caches"],
    })
    pq.write_table(table, tmp_path / "corpus.parquet")


@pytest.mark.parametrize("on_too_long", ["skip", "truncate"])
def test_streaming_variants_read_documents_past_the_context_and_full_skips_them(
    job, tmp_path, short_context_model, on_too_long
):
    _short_and_long_corpus(tmp_path)
    path = job(
        {
            "generation": {"max_tokens": 6, "prefill_step_size": 16},
            "limits": {"on_too_long": on_too_long},
            "variants": [
                {"name": "full", "method": "full"},
                {"name": "pyramid", "method": "pyramidkv", "budget": 12, "eviction": "streaming"},
                {"name": "squeeze", "method": "squeeze", "budget": "10%", "eviction": "streaming"},
                {"name": "snap", "method": "snapkv", "budget": 12},
            ],
        },
        model=str(short_context_model),
    )
    result = invoke("run", path, "-q")
    assert result.exit_code == 0, result.output
    db = tmp_path / "store.db"
    statuses = dict(((d, v), s) for d, v, s in rows(db, "select document_id, variant, status from documents"))
    bounded = "skipped" if on_too_long == "skip" else "done"
    assert statuses == {
        ("short", "full"): "done", ("short", "pyramid"): "done",
        ("short", "squeeze"): "done", ("short", "snap"): "done",
        ("long", "full"): bounded, ("long", "pyramid"): "done",
        ("long", "squeeze"): "done", ("long", "snap"): bounded,
    }
    if on_too_long == "skip":
        reason = rows(db, "select error from documents where document_id = 'long' and variant = 'full'")[0][0]
        assert "context of 160" in reason and "streaming" in reason
    else:
        cut = rows(db, "select prompt_tokens, truncated from documents where document_id = 'long' and variant = 'full'")
        assert cut[0][0] + 6 <= 160 and cut[0][1] == 1
    hashes = rows(db, "select count(distinct prompt_hash) from documents where document_id = 'long' "
                      "and status = 'done'")
    assert hashes == [(1 if on_too_long == "skip" else 2,)], "each kind stored with the prompt it read"
    squeeze = "select prompt_tokens, budget from documents where document_id = 'long' and variant = 'squeeze'"
    prompt_tokens, budget = rows(db, squeeze)[0]
    assert prompt_tokens > 160 and budget == round(prompt_tokens * 0.10)
    over = "select count(*) from layer_stats where method != 'full' and tokens_kept > layer_budget"
    assert rows(db, over) == [(0,)]
    streamed = "document_id = 'long' and variant in ('pyramid', 'squeeze')"
    seen = rows(db, f"select min(tokens_seen / 2) from layer_stats where {streamed}")[0][0]
    assert seen > 160, "every token of the long document was read"


def test_eviction_auto_reads_what_fits_once_with_the_full_cache_and_streams_the_rest(job, tmp_path, short_context_model):
    _short_and_long_corpus(tmp_path)
    path = job(
        {
            "generation": {"max_tokens": 6, "prefill_step_size": 16},
            "limits": {"on_too_long": "skip"},
            "variants": [
                {"name": "full", "method": "full"},
                {"name": "pyramid", "method": "pyramidkv", "budget": 12, "eviction": "auto", "stream_headroom": 2},
            ],
        },
        model=str(short_context_model),
    )
    assert invoke("run", path, "-q").exit_code == 0
    db = tmp_path / "store.db"
    stored = rows(db, "select document_id, variant, status, eviction, reading_seconds is not null, agreement_vs_full "
                      "is not null from documents order by 1, 2")
    assert stored == [
        ("long", "full", "skipped", None, 0, 0),
        ("long", "pyramid", "done", "streaming", 0, 0),  # past the context: streamed, no full output to compare
        ("short", "full", "done", None, 1, 0),
        ("short", "pyramid", "done", "prefill_end", 1, 1),  # fits: cut from the full variant's reading
    ]
    assert invoke("run", path, "-q").exit_code == 0
    assert rows(db, "select count(*) from documents") == [(4,)], "a rerun finds both timings done"


def test_eviction_auto_on_the_full_cache_is_refused_by_field(job):
    result = invoke("run", job({"variants": [{"name": "full", "method": "full", "eviction": "auto"}]}), "-q")
    assert result.exit_code == 2 and "variants[0].eviction: 'auto' is for compressed methods" in result.output


def test_a_ready_prompt_with_a_streaming_variant_says_how_it_ranks(job, tmp_path):
    table = pa.table({"id": ["a"], "prompt": ["Summarize: caches keep budgets."]})
    pq.write_table(table, tmp_path / "prompts.parquet")
    path = job(
        {
            "input": {"path": str(tmp_path / "prompts.parquet"), "id_column": "id", "prompt_column": "prompt",
                      "text_column": None, "prompt_template": "{text}"},
            "variants": [{"name": "pyramid", "method": "pyramidkv", "budget": 12, "eviction": "streaming"}],
        }
    )
    result = invoke("run", path)
    assert result.exit_code == 0, result.output
    assert "SnapKV per chunk" in result.output
