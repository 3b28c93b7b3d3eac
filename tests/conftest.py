import pytest

from tests.tiny_model import build_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random llama model directory (mlx-lm format)."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """``(model, tokenizer)`` for the tiny llama, float32."""
    from pipeline.model_store import load_model

    return load_model(str(tiny_model_dir), weights="float32")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct, imported into the user's model cache."""
    from pipeline.model_store import load_model

    return load_model("smollm2-135m-instruct")
