"""Classes picked out of a module-level class table, or built through `AutoModel.from_config`, are reached:
through a fused copy of the table, or a call naming the fused class."""

import pytest

from fusegen.compiler.build import build
from fusegen.tools.coverage import verify

pytestmark = pytest.mark.slow  # builds and verifies whole model types

TABLES = {
    "gpt_neo": '"eager": FusedGPTNeoSelfAttention,',
    "jamba": "FUSED_ALL_DECODER_LAYER_TYPES = {",
    "nemotron_h": '"full_attention": FusedNemotronHAttention,',
    "gemma4": "self.language_model = FusedGemma4TextModel._from_config(config.text_config)",
}


ATTENTION = {"gpt_neo": "GPTNeoSelfAttention", "jamba": "JambaAttention", "nemotron_h": "NemotronHAttention"}
VARIANTS = {
    # a construction variant each that moves or multiplies the fused attention (found by construction_variants)
    "jamba": "attn_layer_offset=0",
    "nemotron_h": "layers_block_type=['full_attention', 'full_attention', ...",
    "gpt_neo": "tie_word_embeddings=False",
    "gemma4": "tie_word_embeddings=False",
}


@pytest.mark.parametrize(
    "model_type",
    [
        "gpt_neo",
        "gemma4",
        pytest.param("jamba", marks=pytest.mark.slow),
        pytest.param("nemotron_h", marks=pytest.mark.slow),
    ],
)
def test_fused_copy_is_reached_and_the_fused_model_matches_the_original(model_type):
    result = build(model_type)
    assert not [r for o in result.outcomes for r in o.refused if r.rule == "unreachable"]
    assert TABLES[model_type] in result.text
    if model_type in ATTENTION:
        fused = {(o.class_name, plan.merged) for o in result.outcomes for plan in o.fused}
        assert (ATTENTION[model_type], "qkv_proj") in fused
    # Tiny random original saved and loaded into the fused class; logits within 1e-5, same greedy tokens,
    # and every fused class the original's counterpart is built for is built (never the original instead);
    # then the same under every construction variant of the tiny config.
    verification = verify(model_type, result.text)
    assert verification["status"] == "verified", verification
    assert "in none of the configs" not in verification["reason"]
    checks = {check["config"]: check for check in verification["checks"]}
    assert checks["tiny"]["status"] == "verified" and VARIANTS[model_type] in checks, sorted(checks)
    assert checks[VARIANTS[model_type]]["status"] == "verified", checks[VARIANTS[model_type]]
    assert all(check["status"] in ("verified", "skipped") for check in checks.values()), checks
    assert sum(check["status"] == "verified" for check in checks.values()) >= 3 or model_type == "gpt_neo"


def test_an_entry_the_model_never_builds_refuses_to_be_built_and_says_why(tmp_path, monkeypatch):
    # GPTNeoFlashAttention2 inherits q/k/v from the fused class but was never analysed nor validated: selecting it
    # (flash attention, on a GPU) raises a ValueError naming it, never a bare KeyError or a silent unfused copy.
    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import shrunk_config

    text = build("gpt_neo").text
    table = text.split("FUSED_GPT_NEO_ATTENTION_CLASSES = ")[1].split("}")[0]
    assert '"flash_attention_2": GPTNeoFlashAttention2NotFused' in table
    assert '"eager": FusedGPTNeoSelfAttention' in table
    module = import_text(tmp_path, monkeypatch, "gpt_neo", text)
    config = shrunk_config(resolve("gpt_neo").config_class)
    module.FusedGPTNeoForCausalLM(config)  # eager: builds
    # What from_pretrained sets where flash-attn is installed (here Transformers would refuse it before building).
    config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(ValueError, match=r"GPTNeoFlashAttention2 \(entry 'flash_attention_2' of GPT_NEO_ATTENTION"):
        module.FusedGPTNeoAttention(config, layer_id=0)


def test_from_config_of_an_unfused_tower_is_kept():
    # Gemma4Model's vision and audio towers are not fused: their AutoModel.from_config calls stay as they are.
    text = build("gemma4").text
    assert "AutoModel.from_config(config.vision_config)" in text


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def __init__(self, config):\n    self.lm = AutoModel.from_config(config.text_config)", True),
        (
            "def __init__(self, config):\n    config = config.text_config\n    self.lm = AutoModel.from_config(config)",
            False,
        ),
        ("def __init__(self, cfg):\n    self.lm = AutoModel.from_config(cfg.text_config)", False),
    ],
)
def test_from_config_is_followed_only_on_the_class_config_itself(source, expected):
    import ast

    from fusegen.compiler.propagate import _config_is_the_parameter

    assert _config_is_the_parameter(ast.parse(source).body[0]) is expected


def test_a_holder_built_from_a_class_table_is_scoped_by_the_attribute_it_is_assigned_to():
    # `self.compressor = TABLE[kind](config)` places every holder the table names under `compressor`; any other
    # use of the table (passing it on) leaves those holders unscoped ("").
    import ast

    from fusegen.compiler.scopes import holder_references as _holder_references

    classdef = ast.parse(
        "class Attention:\n"
        "    def __init__(self, config):\n"
        "        self.compressor = TABLE[config.kind](config) if config.kind else None\n"
        "        self.other = build_from(TABLE)\n"
    ).body[0]
    references = _holder_references(classdef, {"Holder"}, {"TABLE": {"Holder"}})
    assert sorted(references) == [("Holder", ""), ("Holder", "compressor")]


def import_text(tmp_path, monkeypatch, model_type, text):
    import importlib.util
    import sys

    (tmp_path / f"fused_{model_type}.py").write_text(text)
    spec = importlib.util.spec_from_file_location(
        f"class_tables_fused_{model_type}", tmp_path / f"fused_{model_type}.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_text_model_of_any_type_is_built_through_a_dispatch_on_its_config_type(tmp_path, monkeypatch):
    # GotOcr2Config declares text_config as AutoConfig (any model type, qwen2 by default): the fused file builds
    # FusedQwen2Model exactly when the text config is a Qwen2Config, and AutoModel.from_config as before otherwise.
    from transformers import LlamaConfig, LlamaModel, Qwen2Config

    from fusegen.compiler.resolve import resolve
    from fusegen.compiler.shrink import shrunk_config

    result = build("got_ocr2")
    assert not [r for o in result.outcomes for r in o.refused if r.rule == "unreachable"]
    assert "FusedQwen2Model._from_config(config.text_config)" in result.text
    assert "else AutoModel.from_config(config.text_config)" in result.text
    verification = verify("got_ocr2", result.text)
    assert verification["status"] == "verified", verification
    module = import_text(tmp_path, monkeypatch, "got_ocr2", result.text)
    config = shrunk_config(resolve("got_ocr2").config_class)
    assert isinstance(config.text_config, Qwen2Config)
    assert type(module.FusedGotOcr2Model(config).language_model) is module.FusedQwen2Model
    config.text_config = shrunk_config(LlamaConfig)
    assert type(module.FusedGotOcr2Model(config).language_model) is LlamaModel


def test_a_dispatch_needs_a_plain_argument_and_a_class_the_auto_mapping_names():
    import ast

    from transformers import AutoModel, Qwen2Model, Qwen2PreTrainedModel

    from fusegen.compiler.propagate import _dispatches_to

    def call(source):
        return ast.parse(source, mode="eval").body

    assert _dispatches_to(call("AutoModel.from_config(config.text_config)"), AutoModel, Qwen2Model)
    assert _dispatches_to(call("AutoModel.from_config(text_config)"), AutoModel, Qwen2Model)
    assert not _dispatches_to(call("AutoModel.from_config(config.get_text_config())"), AutoModel, Qwen2Model)
    assert not _dispatches_to(call("AutoModel.from_config(config.text_config)"), AutoModel, Qwen2PreTrainedModel)
