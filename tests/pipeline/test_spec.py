"""Job specs: prompt templates checked by their real fields, and the values a spec refuses (issue 10)."""

import math

import pytest

from pipeline.runner import EXIT_BAD_INPUT
from pipeline.spec import SpecError, load_spec, parse_spec
from tests.pipeline.helpers import invoke


def base_spec(**input_changes):
    return {
        "name": "t",
        "model": "m",
        "input": {"path": "x.parquet", "id_column": "id", "text_column": "text", **input_changes},
    }


# ----- prompt templates are validated by their real fields ------------------------------------


@pytest.mark.parametrize(
    "template, message",
    [
        ("Summarize: {{text}}", "must contain the field {text}"),
        ('Reply as JSON {"a": 1}: {text}', "double them"),
        ("{text} and a stray {", "double them"),
        ("{text} and a stray }", "double them"),
        ("{} {text}", "'{}' is not a column field"),
        ("{text.upper} {text}", "'{text.upper}' is not a column field"),
        ("{text!r}", "'{text!r}' is not a column field"),
    ],
)
def test_prompt_template_fields_are_checked_with_a_real_parser(template, message):
    with pytest.raises(SpecError, match="input.prompt_template") as error:
        parse_spec(base_spec(prompt_template=template))
    assert message in str(error.value)


def test_doubled_braces_are_literal_text(job, tiny_model):
    from pipeline.prompting import build_prompt
    from pipeline.source import Document

    spec = load_spec(job({"input": {"prompt_template": 'Reply like {{"a": 1}}: {text}'}}))
    assert spec.input.template_columns() == ["text"]
    _, tokenizer = tiny_model
    prompt = build_prompt(spec, tokenizer, Document("d", {"text": "hi"}, "h"))
    assert 'Reply like {"a": 1}: hi' in tokenizer.decode(prompt.tokens)


# ----- validation gaps ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"generation": {"seed": -1}}, "generation.seed: must be in [0, 2**64)"),
        ({"generation": {"seed": 2**64}}, "generation.seed: must be in [0, 2**64)"),
        ({"generation": {"temperature": math.nan}}, "generation.temperature: must be a finite number"),
        ({"generation": {"temperature": math.inf}}, "generation.temperature: must be a finite number"),
        ({"generation": {"top_p": math.nan}}, "generation.top_p"),
        ({"generation": {"decode_batch_size": 0}}, "generation.decode_batch_size: must be at least 1"),
        ({"generation": {"decode_batch_memory_mb": 0}}, "generation.decode_batch_memory_mb: must be at least 1"),
        ({"generation": {"decode_batch_size": "many"}}, "generation.decode_batch_size"),
        ({"input": {"path": ""}}, "input.path: must not be empty"),
        ({"input": {"path": "   "}}, "input.path: must not be empty"),
        (
            {"input": {"text_column": None, "prompt_column": "text"}, "limits": {"on_too_long": "truncate"}},
            "limits.on_too_long: 'truncate' cannot cut a ready prompt",
        ),
    ],
)
def test_more_bad_values_are_spec_errors(job, changes, message):
    result = invoke("run", job(changes))
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert message in result.output and "Traceback" not in result.output


def test_seed_at_the_top_of_its_range_is_valid():
    raw = {**base_spec(), "generation": {"seed": 2**64 - 1}}
    assert parse_spec(raw).generation.seed == 2**64 - 1


def test_truncate_with_a_prompt_column_is_refused_also_as_an_override(job):
    path = job({"input": {"text_column": None, "prompt_column": "text"}})
    assert load_spec(path).limits.on_too_long == "fail"  # the default for ready prompts
    result = invoke("run", path, "--on-too-long", "truncate")
    assert result.exit_code == EXIT_BAD_INPUT and "cannot cut a ready prompt" in result.output


@pytest.mark.parametrize(
    "text, key",
    [
        ("name: a\nmodel: m\nname: b\ninput: {path: x, id_column: id, text_column: text}\n", "name"),
        ("name: a\nmodel: m\ninput: {path: x, id_column: id, text_column: text, id_column: other}\n", "id_column"),
    ],
)
def test_duplicate_yaml_keys_are_errors(tmp_path, text, key):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=f"duplicate key '{key}'"):
        load_spec(path)


# ----- eviction: auto streams with the streaming ranking (issue 41, item 10) ------------------


def _auto_variant(**fields):
    spec = base_spec()
    spec["variants"] = [{"name": "p", "method": "pyramidkv", "budget": 128, "eviction": "auto", **fields}]
    return parse_spec(spec).variants[0]


def _ranking(config):
    from velox_cache.cache.choices import PolicyChoices
    from velox_cache.policies import POLICIES

    choices = PolicyChoices.resolve(POLICIES[config.method], config)
    return choices.eviction, choices.kernel, choices.lookahead


@pytest.mark.parametrize("named", [{}, {"kernel": 1, "lookahead": 16}, {"kernel": 3, "lookahead": 8}])
def test_eviction_auto_streams_with_the_streaming_ranking_whatever_prefill_end_names(named):
    variant = _auto_variant(**named)
    kernel, lookahead = named.get("kernel"), named.get("lookahead", 16)  # kernel None: 1 once the draft joins
    assert _ranking(variant.for_document(True).cache) == ("prefill_end", kernel, lookahead)
    assert _ranking(variant.for_document(False).cache) == ("streaming", 31, 0)


def test_eviction_auto_streams_with_the_ranking_named_for_streaming():
    variant = _auto_variant(kernel=1, stream_kernel=15, stream_lookahead=4)
    assert _ranking(variant.for_document(False).cache) == ("streaming", 15, 4)
    with pytest.raises(SpecError, match=r"variants\[0\].stream_kernel: must be odd"):
        _auto_variant(stream_kernel=8)


def test_the_main_job_streams_past_the_context_with_the_streaming_ranking():
    from pathlib import Path

    spec = load_spec(Path(__file__).resolve().parents[2] / "jobs" / "summarize.yaml")
    compressed = [v for v in spec.variants if v.cache.method != "full"]
    assert compressed and all(v.auto_eviction for v in compressed)
    for variant in compressed:
        assert _ranking(variant.for_document(True).cache) == ("prefill_end", None, 16)  # 1 once the draft joins
        assert _ranking(variant.for_document(False).cache) == ("streaming", 31, 0)
