"""Gemma 3 text (Gemma3ForCausalLM) vs HF transformers on tiny random weights saved with
save_pretrained: greedy tokens and logits with both layer kinds (a 16-key window against
prompts of up to 150 tokens, a rope per kind, linear scaling on the full layers), (1 + w)
norms of random weight, a Hub-style config.json, logit softcapping, prefix caching, a
`batchgen run` of chat lines, and the configs batchgen refuses."""

from __future__ import annotations

import json

import pytest
import torch
from engine_utils import assert_last_logits_match, hf_greedy, load_ours, make_engine
from family_checks import NEW_TOKENS, check_chat_run_matches_transformers, greedy, hf_model, prompts
from tiny_models import save_tiny_model

from batchgen.core import Request, SamplingParams
from batchgen.models.registry import UnsupportedModelError


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = save_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"))
    return folder, hf_model(folder), load_ours(folder)


def test_layers_take_their_kinds_window_rope_and_scale(gemma):
    _, _, ours = gemma
    assert type(ours).__name__ == "Gemma3ForCausalLM"
    attns = [layer.self_attn for layer in ours.model.layers]
    assert [a.window for a in attns] == [16, None, 16]
    assert attns[0].rope is attns[2].rope and attns[0].rope is not attns[1].rope
    even = torch.arange(0, 32, 2).float() / 32
    torch.testing.assert_close(attns[0].rope.inv_freq, 1.0 / 10000.0 ** even)
    torch.testing.assert_close(attns[1].rope.inv_freq, 1.0 / 1e6 ** even / 8.0)
    assert all(a.scale == 24 ** -0.5 for a in attns)
    assert ours.model.embedding_multiplier == 8.0  # sqrt(64)
    norm = ours.model.layers[0].post_feedforward_layernorm.weight
    assert norm.abs().mean() > 0.1  # the checkpoint's zero-centred weight, not 1 + w


def test_greedy_tokens_match_hf_batched(gemma):
    _, hf, ours = gemma
    ps = prompts()
    assert greedy(ours, ps) == [hf_greedy(hf, p, NEW_TOKENS) for p in ps]


def test_logits_match_hf(gemma):
    _, hf, ours = gemma
    assert_last_logits_match(ours, hf, prompts(1)[4])


def test_hub_style_config_matches_hf(tmp_path):
    """config.json as the Hub's gemma-3-1b has it: no architectures (read by model_type), no
    layer_types (every `sliding_window_pattern`-th layer full), rope_theta,
    rope_local_base_freq and rope_scaling in place of rope_parameters."""
    folder = save_tiny_model("gemma3", tmp_path, seed=1)
    config = json.loads((folder / "config.json").read_text())
    for key in ("architectures", "layer_types", "rope_parameters"):
        del config[key]
    config.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=10000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    (folder / "config.json").write_text(json.dumps(config))
    hf, ours = hf_model(folder), load_ours(folder)
    assert [layer.self_attn.window for layer in ours.model.layers] == [16, None, 16]
    ps = prompts(2)[1:]
    assert greedy(ours, ps, 24) == [hf_greedy(hf, p, 24) for p in ps]
    assert_last_logits_match(ours, hf, ps[-1])


def test_final_logit_softcapping_matches_hf(tmp_path):
    folder = save_tiny_model("gemma3", tmp_path, seed=2, final_logit_softcapping=2.0)
    hf, ours = hf_model(folder), load_ours(folder)
    ps = prompts(3, (20, 90))
    assert greedy(ours, ps, 16) == [hf_greedy(hf, p, 16) for p in ps]
    assert_last_logits_match(ours, hf, ps[-1])


def test_longrope_on_the_full_layers_stops_the_context_at_its_original_length(tmp_path):
    """A rope per kind of layer (rope_parameters nested by layer type) with longrope on the
    full layers: HF moves those to their long factors past original_max_position_embeddings,
    which ours does not compute, so the context stops there, as for a single longrope, and
    is exact up to it."""
    rope = {"full_attention": {"rope_type": "longrope", "rope_theta": 1e6,
                               "short_factor": [1.0, 1.5] * 8, "long_factor": [4.0] * 16,
                               "original_max_position_embeddings": 100},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    folder = save_tiny_model("gemma3", tmp_path, max_position_embeddings=400,
                             rope_parameters=rope)
    hf, ours = hf_model(folder), load_ours(folder)
    assert ours.max_context == 100
    ps = prompts(6, (40, 99))
    assert greedy(ours, [ps[0]], 16) == [hf_greedy(hf, ps[0], 16)]
    assert_last_logits_match(ours, hf, ps[1])


def test_a_later_request_maps_the_cached_prefix_and_answers_as_hf(gemma):
    """Prefix caching across the window: the second prompt shares the first's 150 tokens,
    maps its two full pages and still answers as HF does."""
    _, hf, ours = gemma
    first = prompts(4, (150,))[0]
    second = first + prompts(5, (30,))[0]
    engine = make_engine(ours)
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.generate([Request("a", first, sampling)])
    [result] = engine.generate([Request("b", second, sampling)])
    assert result.cached_tokens == 128
    assert result.completions[0].token_ids == hf_greedy(hf, second, 16)


@pytest.mark.parametrize(("overrides", "says"), [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "causal attention only"),
])
def test_configs_it_cannot_compute_are_refused(tmp_path, overrides, says):
    folder = save_tiny_model("gemma3", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(overrides)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=says):
        load_ours(folder)


@pytest.mark.parametrize(("config", "says"), [
    ({"architectures": ["Gemma2ForCausalLM"]}, "Gemma 2 caps its attention logits"),
    ({"model_type": "gemma2"}, "Gemma 2 caps its attention logits"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "text-only checkpoints"),
])
def test_gemma2_and_image_text_gemma3_are_refused_with_the_reason(config, says):
    from types import SimpleNamespace

    from batchgen.models.registry import model_class

    with pytest.raises(UnsupportedModelError, match=says):
        model_class(SimpleNamespace(**config))


def test_batchgen_run_answers_chat_lines_like_transformers(tmp_path):
    check_chat_run_matches_transformers("gemma3", tmp_path)