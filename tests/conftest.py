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


@pytest.fixture(params=["native", "pure-mlx"])
def op_path(request, monkeypatch):
    """Run a test on Velox's native ops (where built) and again on its pure-MLX ops (``VELOX_NATIVE=0``)."""
    from velox_cache.kernels import native

    if request.param == "native" and native.ops() is None:
        pytest.skip(f"native ops: {native.status()}")
    if request.param == "pure-mlx":
        monkeypatch.setenv(native.ENVIRONMENT_VARIABLE, "0")
    return request.param
