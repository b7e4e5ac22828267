"""The inputs built for speech models, video towers and NaFlex images make the ORIGINAL run and read them.

Each check runs the original on `forward_inputs` and then on the same batch with the audio (video, image) tensor
redrawn: the output must change, so the batch did reach the tower (a text-only fallback would leave it unchanged).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusegen.compiler import modal_inputs
from fusegen.compiler.modal_inputs import forward_inputs
from fusegen.compiler.resolve import resolve
from fusegen.testkit import random_input, random_model, tiny_config


def _original_and_inputs(model_type, mapping):
    target = resolve(model_type, mapping)
    config = tiny_config(target)
    original = random_model(target.causal_lm, config)
    return original, forward_inputs(original, config, random_input(config, batch=2))


def _output(model, inputs):
    with torch.no_grad():
        output = model(**inputs)
    return output.logits if hasattr(output, "logits") else output[0]


def _reads(model, inputs, key) -> bool:
    """Whether the output changes when `inputs[key]` is redrawn."""
    redrawn = {**inputs, key: torch.randn(inputs[key].shape, generator=torch.Generator().manual_seed(99))}
    return not torch.equal(_output(model, inputs), _output(model, redrawn))


CASES = [
    # (model type, mapping, the tensor the tower reads, its shape given the config; None: not checked)
    ("whisper", "speech-seq2seq", "input_features", (2, 80, 32)),  # channels first, 2 x max_source_positions
    ("speech_to_text", "speech-seq2seq", "input_features", (2, 32, 80)),  # frame-major filter banks
    ("siglip2", "dual-encoder", "pixel_values", (2, 4, 3 * 16 * 16)),  # NaFlex patches of a 2 x 2 grid
]
SLOW_CASES = [
    ("canary", "speech-seq2seq", "input_features", (2, 32, 128)),  # the encoder sub-config's mel bins
    ("seamless_m4t", "speech-seq2seq", "input_features", (2, 32, 160)),
    ("moonshine", "speech-seq2seq", "input_values", (2, 4000)),
    ("speecht5", "speech-seq2seq", "input_values", (2, 16 * 320)),
    ("voxtral_realtime", "speech-seq2seq", "input_features", (2, 128, 96)),  # one audio embedding per token
    ("fun_asr_nano", "speech-seq2seq", "input_features", None),  # audio tokens placed in input_ids
    ("voxtral", "speech-seq2seq", "input_features", None),
    ("qwen3_asr", "speech-seq2seq", "input_features", (2, 128, 100)),  # whole chunks of 2 * n_window frames
    ("videoprism", "dual-encoder", "pixel_values_videos", (2, 2, 3, 72, 72)),
    ("align", "dual-encoder", "pixel_values", (2, 3, 64, 64)),
    ("moonshine_streaming", "speech-seq2seq", "input_values", (2, 4000)),  # its tiny config sets the kv heads
    ("vibevoice_asr", "speech-seq2seq", "input_values", (2, 1, 16 * 3200)),  # at audio tokens, channel axis
]


def _check(model_type, mapping, key, shape):
    original, inputs = _original_and_inputs(model_type, mapping)
    assert key in inputs, sorted(inputs)
    if shape is not None:
        assert tuple(inputs[key].shape) == shape
    _output(original, inputs)  # runs
    assert _reads(original, inputs, key)


@pytest.mark.parametrize(("model_type", "mapping", "key", "shape"), CASES)
def test_the_original_runs_on_and_reads_the_built_inputs(model_type, mapping, key, shape):
    _check(model_type, mapping, key, shape)


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "mapping", "key", "shape"), SLOW_CASES)
def test_the_original_runs_on_and_reads_the_built_inputs_slow(model_type, mapping, key, shape):
    _check(model_type, mapping, key, shape)


def test_audio_tokens_match_the_audio_embeddings():
    # Fun-ASR-Nano checks that placeholders and embeddings agree; the text keeps its own tokens around them
    original, inputs = _original_and_inputs("fun_asr_nano", "speech-seq2seq")
    token = modal_inputs.audio_token_id(original.config)
    assert (inputs["input_ids"] == token).sum() > 0
    assert inputs["input_features_mask"].shape == inputs["input_features"].shape[:2]


def test_pop2piano_gets_token_ids_alone_when_it_refuses_both():
    # its `input_features` are the encoder's input embeddings: with token ids it refuses them
    _, inputs = _original_and_inputs("pop2piano", "speech-seq2seq")
    assert "input_ids" in inputs and "input_features" not in inputs and "decoder_input_ids" in inputs


class _Config:
    def __init__(self, **values):
        self.__dict__.update(values)
        self.sub_configs = {}


def test_feature_widths_and_frames_come_from_the_config():
    generator = torch.Generator().manual_seed(0)
    assert modal_inputs.feature_widths(_Config(input_feat_per_channel=40, input_channels=2)) == [80]
    assert modal_inputs.feature_widths(_Config()) == [80]
    [(first, frames), (second, _), (third, plain), _] = modal_inputs.audio_feature_options(
        _Config(num_mel_bins=12, max_source_positions=8, n_window=5), 1, generator
    )
    assert frames == 20 and first.shape == (1, 12, 20) and second.shape == (1, 20, 12)  # whole chunks of 10 first
    assert plain == 16 and third.shape == (1, 12, 16)  # then the encoder's positions as they are
    assert modal_inputs.waveform(_Config(conv_stride=[5, 2]), 1, generator).shape == (1, 16 * 10)


def test_the_train_step_draws_numpy_augmentation_the_same_for_both_models():
    # SpeechT5 masks frames with np.random in train mode; unseeded, the fused model masked other frames
    from fusegen.compiler.validate import _train_step

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, input_ids, attention_mask=None, use_cache=None):
            noise = torch.from_numpy(np.random.rand(3))
            return (self.weight * noise * input_ids.shape[1],)

    model, ids = Noisy(), torch.zeros(1, 4, dtype=torch.long)
    before = np.random.get_state()[1].copy()
    first, _ = _train_step(model, ids, checkpointing=False)
    second, _ = _train_step(model, ids, checkpointing=False)
    assert torch.equal(first, second)
    assert np.array_equal(np.random.get_state()[1], before)  # the caller's generator is left as it was


def test_the_meta_trace_records_the_audio_tower_on_audio_features():
    # the trace used to run token ids alone, so Parakeet's encoder attention was traced with synthetic inputs
    from fusegen.compiler.trace import record_inputs

    target = resolve("canary", "speech-seq2seq")
    with torch.device("meta"):
        model = target.causal_lm(target.config_class())
    attention = next(m for m in model.modules() if type(m).__name__ == "ParakeetEncoderAttention")
    recorded = record_inputs(model, [attention])
    assert id(attention) in recorded


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "given"),
    [
        ("whisper:speech-seq2seq", "given decoder_input_ids, input_features"),
        ("siglip2:dual-encoder", "given pixel_attention_mask, pixel_values, spatial_shapes"),
    ],
)
def test_the_coverage_tool_compares_models_whose_forward_reads_no_token_ids_alone(target, given):
    # whisper's forward takes no input_ids: its batch used to be dropped, and the check skipped as text-only
    from fusegen.compiler.build import build
    from fusegen.tools import coverage

    model_type, _, mapping = target.partition(":")
    text = build(target).text
    [(_, result)] = list(coverage.run_isolated([(target, coverage.verify, (model_type, text, 0, mapping))], 1, 900))
    assert result["status"] == "verified", result["reason"]
    assert given in result["reason"]


def test_a_generated_class_that_never_runs_fails_the_coverage_check():
    # VibeVoice's acoustic-tokenizer decoder only runs in generation: a forward cannot verify its fused norm
    from fusegen.compiler.validate import executed

    class Used(torch.nn.Module):
        def forward(self, x):
            return x

    class Idle(torch.nn.Module):
        def forward(self, x):
            return x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.idle = Used(), Idle()

        def forward(self, x):
            return self.used(x)

    with executed(Model(), {"Used", "Idle"}) as ran:
        Model()(torch.ones(1))  # another instance: nothing recorded
    assert ran == {"Used": False, "Idle": False}
    model = Model()
    with executed(model, {"Used", "Idle"}) as ran:
        model(torch.ones(1))
    assert ran == {"Used": True, "Idle": False}
