"""The model importer, the loader and the embedded default model."""

import json
import os

import pytest
from click.testing import CliRunner

from pipeline import model_import, model_store
from pipeline.cli import cli


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    directory = tmp_path / "models"
    monkeypatch.setenv("VELOX_MODELS_DIR", str(directory))
    return directory


@pytest.fixture(scope="module")
def embedded_gguf():
    return model_store.embedded_gguf_path()


def test_import_matches_the_gguf_config(models_dir):
    directory = model_store.import_model()
    config = json.loads((directory / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["rope_traditional"] is True
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())
    assert [m.name for m in model_store.list_models()] == ["smollm2-135m-instruct"]


def test_import_is_idempotent(models_dir):
    first = model_store.import_model()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = model_store.import_model()
    assert second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp


def test_interrupted_import_leaves_nothing_behind(models_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_import, "build_tokenizer_files", fail)
    with pytest.raises(KeyboardInterrupt):
        model_store.import_model()
    assert list(models_dir.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("VELOX_MODELS_DIR", str(models_dir))
    assert (model_store.import_model() / model_import.COMPLETE_MARKER).is_file()


@pytest.mark.parametrize("size", [100, 5_000_000])
def test_truncated_gguf_gives_clear_error(tmp_path, models_dir, embedded_gguf, size):
    truncated = tmp_path / "truncated.gguf"
    with open(embedded_gguf, "rb") as source:
        truncated.write_bytes(source.read(size))
    with pytest.raises(model_import.ModelImportError, match="truncated.gguf.*corrupt or truncated"):
        model_store.import_model(truncated)
    assert not models_dir.exists() or not any(models_dir.iterdir())


def test_corrupt_gguf_gives_clear_error(tmp_path, models_dir):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(os.urandom(4096))
    with pytest.raises(model_import.ModelImportError, match="corrupt.gguf"):
        model_store.import_model(corrupt)


def test_missing_gguf_gives_clear_error_and_exit_status(tmp_path, models_dir):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(model_import.ModelImportError, match="not found.*missing.gguf"):
        model_store.resolve_model(str(missing))
    result = CliRunner().invoke(cli, ["models", "import", str(missing)])
    assert result.exit_code == 1
    assert "missing.gguf" in result.output


def test_unknown_model_name_lists_the_accepted_forms(models_dir):
    with pytest.raises(model_import.ModelImportError, match="smollm2-135m-instruct"):
        model_store.resolve_model("no-such-model")


def test_weights_follow_the_backend_and_can_be_overridden(monkeypatch):
    from velox_cache.kernels import quantized

    monkeypatch.delenv("VELOX_WEIGHTS", raising=False)
    monkeypatch.setattr(model_store, "backend_name", lambda: "metal")
    monkeypatch.setattr(quantized, "available", lambda: False)
    assert model_store.weights_mode() == "quantized"
    monkeypatch.setattr(model_store, "backend_name", lambda: "cpu")
    assert model_store.weights_mode() == "float32"  # MLX's CPU quantized matmul is scalar: not the default
    monkeypatch.setattr(quantized, "available", lambda: True)
    assert model_store.weights_mode() == "quantized"  # on Velox's native quantized matmul
    monkeypatch.setenv("VELOX_WEIGHTS", "float32")
    assert model_store.weights_mode() == "float32"
    assert model_store.weights_mode("quantized") == "quantized"
    with pytest.raises(ValueError, match="weights"):
        model_store.weights_mode("int3")


def test_tiny_model_loads_as_float32(tiny_model):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, tokenizer = tiny_model
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    assert tokenizer.encode("hi") == [74, 75]


@pytest.mark.integration
def test_smollm2_answers_paris(smollm2):
    import mlx_lm

    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    assert "Paris" in answer


def test_a_gguf_path_names_a_model(models_dir, embedded_gguf):
    directory = model_store.resolve_model(str(embedded_gguf))
    assert directory.parent == models_dir
    assert (directory / model_import.COMPLETE_MARKER).is_file()
    assert model_store.resolve_model(str(directory)) == directory  # an mlx-lm directory names itself


def test_weights_dequantized_exactly_key_other_rows_than_those_of_the_float16_rounding(job, tmp_path, monkeypatch):
    """Rows stored before the float32 weights were ggml's exact values came from other weights: other keys."""
    from pipeline.spec import load_spec

    monkeypatch.setenv("VELOX_WEIGHTS", "float32")
    from tests.pipeline.helpers import invoke, rows, write_corpus

    assert model_store.hashed_weights("float32") == {"weights": "float32", "dequantized": "exact"}
    assert model_store.hashed_weights("quantized") == {"weights": "quantized", "kernels": model_store.quantized_kernels()}
    write_corpus(tmp_path / "corpus.parquet", n=1)
    path = job(variants=[{"name": "full", "method": "full"}])
    assert invoke("run", path, "-q").exit_code == 0
    spec = load_spec(str(path))
    before = spec.output_settings_hash(weights=model_store.weights_mode())
    stored = rows(tmp_path / "store.db", "select settings_hash from documents")
    assert stored == [(spec.output_settings_hash(**model_store.hashed_weights()),)] and stored != [(before,)]


def test_quantized_rows_are_keyed_by_the_kernels_that_ran(job, tmp_path, monkeypatch):
    """The native 4-bit matmul and MLX's give other outputs: a store written on one path never serves the other."""
    from velox_cache.kernels import native, quantized
    from tests.pipeline.helpers import invoke, rows, write_corpus

    monkeypatch.setenv("VELOX_WEIGHTS", "quantized")
    write_corpus(tmp_path / "corpus.parquet", n=1)
    path = job(variants=[{"name": "full", "method": "full"}])
    monkeypatch.setenv(quantized.ENVIRONMENT_VARIABLE, "0")
    assert model_store.quantized_kernels() in ("routed-mlx", f"mlx-{model_store.backend_name()}")
    assert invoke("run", path, "-q").exit_code == 0
    monkeypatch.delenv(quantized.ENVIRONMENT_VARIABLE)
    if native.ops() is None or model_store.backend_name() != "cpu":
        pytest.skip(f"one kernel path here: {model_store.quantized_kernels()}")
    assert model_store.quantized_kernels() == f"routed-native-{native.ops().quantized_instruction_set()}"
    assert invoke("run", path, "-q").exit_code == 0
    assert rows(tmp_path / "store.db", "select count(distinct settings_hash), count(*) from documents") == [(2, 2)]
    devices = [device for (device,) in rows(tmp_path / "store.db", "select device from runs order by id")]
    assert "routed-mlx" in devices[0] and "routed-native-" in devices[1]
