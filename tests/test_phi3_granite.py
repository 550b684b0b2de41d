"""Phi-3/3.5/4 and Granite 3.x vs HF transformers on tiny random weights saved with
save_pretrained: greedy tokens and logits, and each family's config variants (Phi-3's sliding
window, partial rotary and longrope; Granite's multipliers and bias flags)."""

from __future__ import annotations

import json

import pytest
from engine_utils import assert_last_logits_match, hf_greedy, load_ours
from family_checks import NEW_TOKENS, greedy, hf_model, prompts
from safetensors.torch import load_file
from tiny_models import save_tiny_model

FAMILIES = ["phi3", "granite"]


def assert_matches_hf(folder, ps, max_tokens=24):
    """Greedy tokens of every prompt, batched, and the last prompt's logits, as HF's."""
    hf, ours = hf_model(folder), load_ours(folder)
    assert greedy(ours, ps, max_tokens) == [hf_greedy(hf, p, max_tokens) for p in ps]
    assert_last_logits_match(ours, hf, ps[-1])
    return ours


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, hf_model(folder), load_ours(folder)


def test_class_and_checkpoint_names_are_the_families(family):
    name, folder, _, ours = family
    names = set(load_file(str(folder / "model.safetensors")))
    if name == "phi3":  # fused in the checkpoint already: each loads whole
        assert type(ours).__name__ == "Phi3ForCausalLM"
        assert {"model.layers.0.self_attn.qkv_proj.weight",
                "model.layers.0.mlp.gate_up_proj.weight"} <= names
        assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    else:
        assert type(ours).__name__ == "GraniteForCausalLM"
        assert ours.logits_scaling == 8.0 and ours.model.embedding_multiplier == 12.0
        layer = ours.model.layers[0]
        assert (layer.residual_multiplier, layer.self_attn.scale) == (0.22, 0.0625)


def test_greedy_tokens_match_hf_batched(family):
    _, _, hf, ours = family
    ps = prompts()
    assert greedy(ours, ps) == [hf_greedy(hf, p, NEW_TOKENS) for p in ps]


def test_logits_match_hf(family):
    _, _, hf, ours = family
    assert_last_logits_match(ours, hf, prompts(1)[4])


def test_config_without_architectures_is_read_by_model_type(family, tmp_path):
    name, folder, _, ours = family
    for item in ("config.json", "model.safetensors"):
        (tmp_path / item).write_bytes((folder / item).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert type(load_ours(tmp_path)) is type(ours)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": 100}

PHI3_VARIANTS = {
    # Phi-3-mini-4k's kind: a window on every layer (16 keys against prompts of up to 150).
    "sliding_window": dict(sliding_window=16),
    # Phi-4-mini's kind: 3/4 of each head rotated (12 of 16 features), the rest passed through.
    "partial_rotary": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75}),
}


@pytest.mark.parametrize("case", sorted(PHI3_VARIANTS))
def test_phi3_config_variants_match_hf(case, tmp_path):
    folder = save_tiny_model("phi3", tmp_path, seed=1, **PHI3_VARIANTS[case])
    ours = assert_matches_hf(folder, prompts(3)[1:])
    if case == "partial_rotary":
        assert ours.model.layers[0].self_attn.rope.cos.shape[-1] == 12


def test_phi3_longrope_short_factors_and_attention_scaling_match_hf(tmp_path, caplog):
    """Phi-3-mini-128k / Phi-3.5 / Phi-4-mini: longrope with partial rotary. Up to
    original_max_position_embeddings HF uses the short factors, and its attention scaling
    (sqrt(1 + ln(4) / ln(100)) here, from max_position_embeddings / original) from the first
    token: ours is exact there, and stops the context at that length, saying so."""
    rope = dict(LONGROPE, partial_rotary_factor=0.75, short_factor=[1.0, 1.5, 2.0, 1.0, 1.2, 3.0],
                long_factor=[4.0] * 6)
    folder = save_tiny_model("phi3", tmp_path, seed=2, max_position_embeddings=400,
                             original_max_position_embeddings=100, rope_parameters=rope)
    with caplog.at_level("WARNING", logger="batchgen.models"):
        ours = assert_matches_hf(folder, prompts(4, (5, 40, 60)), 39)
    assert ours.max_context == 100
    assert "longrope" in caplog.text and "100 tokens (of 400)" in caplog.text
    assert ours.model.layers[0].self_attn.rope.scaling > 1.1
    hf = hf_model(folder)
    assert_last_logits_match(ours, hf, prompts(5, (99,))[0])  # the longest prompt it takes


def test_phi3_longrope_prompt_past_its_original_length_is_a_line_error(tmp_path):
    """Past original_max_position_embeddings HF switches to the long factors (and, in
    generate, recomputes every cached key then): not implemented. Such a prompt is refused
    with a per-line error naming the context, never run with the wrong rotation."""
    from batchgen.io.intake import IntakeError, intake
    from batchgen.io.reader import RawRecord
    from tiny_models import embedded_tokenizer

    rope = dict(LONGROPE, partial_rotary_factor=1.0, short_factor=[1.0] * 8,
                long_factor=[4.0] * 8)
    folder = save_tiny_model("phi3", tmp_path, max_position_embeddings=400,
                             original_max_position_embeddings=100, rope_parameters=rope)
    ours = load_ours(folder)
    record = RawRecord(1, {"custom_id": "long", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": list(range(3, 103)), "max_tokens": 4}})
    error = intake(record, embedded_tokenizer(), ours.max_context)
    assert isinstance(error, IntakeError) and error.code == "context_length_exceeded"
    assert "100 tokens" in error.message


GRANITE_VARIANTS = {
    "biases": dict(attention_bias=True, mlp_bias=True),  # q/k/v/o and the MLP, as Llama's
    "untied_defaults": dict(embedding_multiplier=1.0, residual_multiplier=1.0,
                            attention_multiplier=1.0, logits_scaling=1.0,
                            tie_word_embeddings=False),
}


@pytest.mark.parametrize("case", sorted(GRANITE_VARIANTS))
def test_granite_config_variants_match_hf(case, tmp_path):
    assert_matches_hf(save_tiny_model("granite", tmp_path, seed=1, **GRANITE_VARIANTS[case]),
                      prompts(3)[1:])


def test_granite_ignores_a_sliding_window_left_in_its_config(tmp_path):
    """HF's Granite has no window (as its Llama): one in config.json changes nothing."""
    folder = save_tiny_model("granite", tmp_path, sliding_window=16)
    assert all(layer.self_attn.window is None for layer in load_ours(folder).model.layers)
