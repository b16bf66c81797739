import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from tests.adapterhub_models import Built, build


@pytest.fixture(scope="session", params=["safetensors", "bin"])
def built(request, tmp_path_factory) -> Built:
    """A tiny model saved by AdapterHub, in each of its two weight formats."""
    return build(tmp_path_factory.mktemp(request.param), safetensors=request.param == "safetensors")


@pytest.fixture(scope="session")
def built_st(tmp_path_factory) -> Built:
    """One safetensors build, for tests that need a model but not both formats."""
    return build(tmp_path_factory.mktemp("st"), safetensors=True, seed=3)
