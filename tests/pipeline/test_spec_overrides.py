"""``JobSpec.with_overrides``: ``velox-batch run``'s options applied to a spec, without the CLI."""

import re

import pytest

from pipeline.spec import SpecError, parse_spec

RAW = {
    "name": "t",
    "model": "m",
    "input": {"path": "x.parquet", "id_column": "id", "text_column": "text"},
    "variants": [
        {"name": "full", "method": "full"},
        {"name": "pyramid", "method": "pyramidkv", "budget": 24},
        {"name": "squeeze", "method": "squeeze", "budget": 24},
    ],
}


def spec(**changes):
    return parse_spec({**RAW, **changes})


def test_no_options_change_nothing_and_the_spec_given_is_left_as_it_was():
    original = spec()
    assert original.with_overrides() == original
    changed = original.with_overrides(db="/tmp/other.db", limit=2, model="other", variants=["squeeze"])
    assert (changed.output.db, changed.limits.max_documents, changed.model) == ("/tmp/other.db", 2, "other")
    assert [v.name for v in changed.variants] == ["squeeze"]
    assert original == spec()  # a copy is changed, not the spec itself


def test_each_option_sets_its_field():
    changed = spec(limits={"on_too_long": "fail"}).with_overrides(max_prompt_tokens=100, on_too_long="skip")
    assert (changed.limits.max_prompt_tokens, changed.limits.on_too_long) == (100, "skip")
    assert changed.source is None and changed.generation == spec().generation


def test_variants_run_in_the_order_given():
    assert [v.name for v in spec().with_overrides(variants=("squeeze", "full")).variants] == ["squeeze", "full"]


def test_an_unknown_variant_names_the_option_and_the_known_variants():
    with pytest.raises(SpecError, match=re.escape("--variant: 'fast' is not in the spec; variants: full, pyramid, squeeze")):
        spec().with_overrides(variants=["full", "fast"])


@pytest.mark.parametrize("option, values", [("--workers", {"workers": 2}), ("--address", {"address": "host:6379"})])
def test_ray_options_need_the_ray_engine(option, values):
    name = option[2:]
    message = f"{option}: only the ray engine has {name} (add --engine ray)"
    with pytest.raises(SpecError, match=re.escape(message)):
        spec().with_overrides(**values)
    changed = spec().with_overrides(engine="ray", **values)
    assert changed.engine.name == "ray" and getattr(changed.engine, name) == next(iter(values.values()))
    assert getattr(spec(engine={"name": "ray"}).with_overrides(**values).engine, name) is not None


def test_the_in_process_engine_drops_the_specs_ray_settings():
    ray = spec(engine={"name": "ray", "workers": 3, "address": "host:6379"})
    changed = ray.with_overrides(engine="in-process")
    assert (changed.engine.name, changed.engine.workers, changed.engine.address) == ("in-process", None, None)
    assert ray.engine.workers == 3
    with pytest.raises(SpecError, match=re.escape("--workers: only the ray engine has workers (add --engine ray)")):
        ray.with_overrides(engine="in-process", workers=2)


def test_the_result_is_validated_again():
    ready = parse_spec({**RAW, "input": {"path": "x.parquet", "id_column": "id", "prompt_column": "prompt"}})
    assert ready.limits.on_too_long == "fail"
    with pytest.raises(SpecError, match=re.escape("limits.on_too_long: 'truncate' cannot cut a ready prompt")):
        ready.with_overrides(on_too_long="truncate")


def test_empty_values_leave_the_spec_alone():
    """As the command line gives them when an option is left out (``--variant`` gives an empty tuple)."""
    original = spec()
    kept = original.with_overrides(db=None, limit=None, variants=(), max_prompt_tokens=None, on_too_long=None,
                                   model=None, engine=None, workers=None, address=None)
    assert kept == original
