import pytest
import torch

from fusegen.compiler.validate import GRAD_TOLERANCE, TOLERANCE  # noqa: F401 - the one tolerance pair tests share

TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}


def tiny_config(config_class, **overrides):
    """A small random-model config: 2 layers, hidden 64, vocab 128."""
    return config_class(**{**TINY, **overrides})


def random_model(model_class, config, seed=0):
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Default init leaves biases at zero; randomise every tensor so a mis-sliced bias shows.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    return model


@pytest.fixture
def checkpoint(tmp_path):
    """Save a random original-class model; returns (path, model)."""

    def make(model_class, config, **save_kwargs):
        model = random_model(model_class, config)
        path = tmp_path / "original"
        model.save_pretrained(path, **save_kwargs)
        return path, model

    return make
