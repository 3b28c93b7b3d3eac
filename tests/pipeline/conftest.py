import pytest
import yaml

from tests.pipeline.helpers import write_corpus


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    """Write a corpus and a spec; returns a function that writes the spec with changes and its path."""
    corpus = write_corpus(tmp_path / "corpus.parquet")

    def make(changes=None, **top):
        spec = {
            "name": "tiny-job",
            "model": str(tiny_model_dir),
            "input": {
                "path": str(corpus),
                "id_column": "id",
                "text_column": "text",
                "prompt_template": "About {topic}: {text}\nSummarize.",
            },
            "generation": {"max_tokens": 6, "prefill_step_size": 32},
            "variants": [
                {"name": "full", "method": "full"},
                {"name": "pyramid", "method": "pyramidkv", "budget": 24},
                {"name": "squeeze", "method": "squeeze", "budget": 24},
            ],
            "output": {"db": str(tmp_path / "store.db")},
        }
        for section, values in (changes or {}).items():
            spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
        spec.update(top)
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    return make
