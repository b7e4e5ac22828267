"""Building models on meta from default configs that the installed Transformers leaves incomplete."""

import pytest

from fusegen.compiler.instantiate import candidates, instantiate
from fusegen.compiler.resolve import resolve
from fusegen.errors import InputError


def test_llama_builds_on_meta_without_memory():
    model = instantiate(resolve("llama"))
    assert all(parameter.is_meta for parameter in model.parameters())
    # The linear kinds want the attention and the MLP, the rmsnorm kind the norm.
    assert [cls.__name__ for cls in candidates(model)] == ["LlamaAttention", "LlamaMLP", "LlamaRMSNorm"]


@pytest.mark.parametrize("model_type", ["ministral", "emu3"])
def test_known_gaps_in_default_configs_are_filled(model_type):
    # ministral leaves head_dim None; emu3 never sets pad_token_id (transformers 5.24).
    model = instantiate(resolve(model_type))
    assert candidates(model)


def test_a_config_that_cannot_be_repaired_is_an_input_error():
    with pytest.raises(InputError, match="cannot be built on the meta device"):
        instantiate(resolve("musicgen"))
