"""Our models vs HF transformers on the same random weights: greedy tokens and logits."""

import json

import pytest
import torch

from engine_utils import (assert_last_logits_match, greedy_requests, hf_greedy, load_ours,
                          make_engine)
from tiny_models import VOCAB, save_tiny_model

FAMILIES = ["llama", "llama_tied", "qwen2", "qwen3", "mistral"]


def prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 64, 65, 150]  # within a page, exactly one page, crossing pages
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return request.param, hf, load_ours(folder)


def test_greedy_tokens_match_hf_batched(family_models):
    _, hf, ours = family_models
    ps = prompts()
    engine = make_engine(ours)
    results = engine.generate(greedy_requests(ps, 80, ignore_eos=True))
    for prompt, result in zip(ps, results):
        assert result.completions[0].token_ids == hf_greedy(hf, prompt, 80)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "phi3", "granite", "gemma3"])
def test_greedy_tokens_match_hf_through_the_cuda_kernels(family, tmp_path):
    """On CUDA the Triton kernels run (float32 weights): Qwen3's per-head q/k norms read the
    fused QKV output; Phi-3's fused checkpoint projections, Granite's multipliers and Gemma 3's
    windows, two ropes and (1 + w) norms take the same kernels."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(family, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ps = prompts()
    results = make_engine(load_ours(folder, device="cuda")).generate(
        greedy_requests(ps, 40, ignore_eos=True))
    for prompt, result in zip(ps, results):
        assert result.completions[0].token_ids == hf_greedy(hf, prompt, 40)


def test_logits_match_hf(family_models):
    _, hf, ours = family_models
    prompt = prompts(1)[4]
    assert_last_logits_match(ours, hf, prompt)


def test_batched_equals_one_at_a_time(family_models):
    _, _, ours = family_models
    ps = prompts(2)
    together = [r.completions[0].token_ids
                for r in make_engine(ours).generate(greedy_requests(ps, 40, ignore_eos=True))]
    alone = [make_engine(ours).generate(greedy_requests([p], 40, ignore_eos=True))[0]
             .completions[0].token_ids
             for p in ps]
    assert together == alone


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_bias_flags_read_as_each_family_does(family, tmp_path):
    """`attention_bias` / `mlp_bias` set: Llama biases q/k/v/o and the MLP, Qwen3 its
    attention only, Qwen2 q/k/v whatever the flags say, Mistral nothing. A mismatch either
    fails to load (a tensor without a place, or one missing) or gives other logits."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(family, tmp_path, attention_bias=True, mlp_bias=True)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    has_bias = {n for n, _ in hf.named_parameters() if n.endswith(".bias")}
    expected = {"llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"},
                "qwen3": {"q_proj", "k_proj", "v_proj", "o_proj"},
                "qwen2": {"q_proj", "k_proj", "v_proj"}, "mistral": set()}[family]
    assert {n.split(".")[-2] for n in has_bias} == expected  # what the checkpoint holds
    ours = load_ours(folder)
    prompt = prompts(3)[3]
    assert_last_logits_match(ours, hf, prompt)


@pytest.mark.parametrize(("family", "hidden_act", "device"), [
    ("llama", "gelu", "cpu"), ("qwen2", "gelu_pytorch_tanh", "cpu"), ("mistral", "relu", "cpu"),
    ("qwen3", "swish", "cpu"),
    pytest.param("llama", "gelu_pytorch_tanh", "cuda", marks=pytest.mark.gpu)])
def test_mlp_activation_follows_hidden_act(family, hidden_act, device, tmp_path):
    """The gated MLP applies the config's `hidden_act` (SiLU only through its fused kernel,
    which a GPU leaves for transformers' module otherwise)."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(family, tmp_path, hidden_act=hidden_act)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_ours(folder, device=device)
    ps = prompts(4)[2:4]
    if device == "cpu":  # one prefill against HF's logits (the helper's pool is on the CPU)
        assert_last_logits_match(ours, hf, ps[1])
    results = make_engine(ours).generate(greedy_requests(ps, 30, ignore_eos=True))
    for prompt, result in zip(ps, results):
        assert result.completions[0].token_ids == hf_greedy(hf, prompt, 30)


def test_unknown_hidden_act_is_refused_by_name(tmp_path):
    from batchgen.models.registry import UnsupportedModelError

    folder = save_tiny_model("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "wobbly"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="hidden_act 'wobbly'"):
        load_ours(folder)


def test_longrope_runs_exactly_up_to_its_original_length(tmp_path):
    """HF moves a longrope model to its long factors once a sequence passes
    original_max_position_embeddings; ours stops its context there (longer prompts become
    per-line errors) and is exact up to it, the longest prompt included."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("llama", tmp_path, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8, "original_max_position_embeddings": 100})
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_ours(folder)
    assert ours.max_context == 100
    longest = torch.randint(3, VOCAB, (99,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_last_logits_match(ours, hf, longest)
    result = make_engine(ours).generate(greedy_requests([longest[:60]], 40, ignore_eos=True))
    assert result[0].completions[0].token_ids == hf_greedy(hf, longest[:60], 40)


def test_dynamic_rope_runs_exactly_up_to_max_position_embeddings(tmp_path, caplog):
    """HF's dynamic NTK scaling starts once a sequence passes max_position_embeddings (and
    rescales every key then); up to there it is the unscaled rope. Ours stops the context there,
    exact up to it, and says so: the factor does not lengthen it."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("llama", tmp_path, max_position_embeddings=64, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with caplog.at_level("WARNING", logger="batchgen.models"):
        ours = load_ours(folder)
    assert ours.max_context == 64
    assert "dynamic" in caplog.text and "64 tokens" in caplog.text
    assert caplog.text.count("context limited") == 1  # once a model, not once per rope table
    longest = torch.randint(3, VOCAB, (63,), generator=torch.Generator().manual_seed(6)).tolist()
    assert_last_logits_match(ours, hf, longest)


WINDOWED = {
    # A sliding layer below max_window_layers: layer_types, when listed, is what HF applies.
    "qwen2_layer_types": ("qwen2", dict(use_sliding_window=True, sliding_window=16,
                                        max_window_layers=2, layer_types=[
                                            "sliding_attention", "full_attention",
                                            "sliding_attention"])),
    "qwen3_layer_types": ("qwen3", dict(use_sliding_window=True, sliding_window=16,
                                        max_window_layers=2, layer_types=[
                                            "sliding_attention", "full_attention",
                                            "full_attention"])),
    # A config.json without layer_types (older writers): derived from max_window_layers, here
    # sliding from layer 1 on (the test removes the list after saving).
    "qwen2_max_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=16,
                                              max_window_layers=1, layer_types=[
                                                  "full_attention", "sliding_attention",
                                                  "sliding_attention"])),
    # Mistral windows every layer; a Mistral config listing layer_types loads as Ministral,
    # which follows them.
    "mistral": ("mistral", dict(sliding_window=16)),
    "mistral_layer_types": ("mistral", dict(sliding_window=16, layer_types=[
        "full_attention"] * 3)),
}


@pytest.mark.parametrize("case", sorted(WINDOWED))
def test_sliding_windows_follow_hf(case, tmp_path):
    """Windows of 16 keys against prompts of up to 150 tokens: greedy tokens and last logits
    as HF computes them, per family and per way a config states which layers slide."""
    from transformers import AutoModelForCausalLM

    family, overrides = WINDOWED[case]
    folder = save_tiny_model(family, tmp_path, **overrides)
    if case.endswith("max_window_layers"):
        config = json.loads((folder / "config.json").read_text())
        del config["layer_types"]
        (folder / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_ours(folder)
    ps = prompts(3)[1:]
    results = make_engine(ours).generate(greedy_requests(ps, 24, ignore_eos=True))
    for prompt, result in zip(ps, results):
        assert result.completions[0].token_ids == hf_greedy(hf, prompt, 24)
    assert_last_logits_match(ours, hf, ps[-1])


def test_llama_ignores_a_sliding_window_left_in_its_config(tmp_path):
    """HF's Llama attends to every earlier token: a `sliding_window` left in a Llama
    config.json (a Mistral or Qwen converted to Llama) changes nothing in its forward. HF's
    generate does read it (its cache keeps only that many keys, unlike the forward it runs), so
    the reference here is greedy over whole forwards, without a cache."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("llama", tmp_path, sliding_window=16)
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == 16
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_ours(folder)
    ps = prompts(3)[1:3]
    results = make_engine(ours).generate(greedy_requests(ps, 24, ignore_eos=True))
    for prompt, result in zip(ps, results):
        assert result.completions[0].token_ids == hf_greedy(hf, prompt, 24, use_cache=False)
    assert_last_logits_match(ours, hf, ps[-1])


def test_yarn_runs_past_max_position_embeddings_to_original_times_factor(tmp_path):
    """Qwen's long-context recipe: YaRN with original_max_position_embeddings at the trained
    length and max_position_embeddings left there. YaRN's frequencies are fixed, so the context
    is original x factor (as vLLM derives it), and a prompt past max_position_embeddings
    answers as HF does."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("llama", tmp_path, max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64})
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_ours(folder)
    assert ours.max_context == 256
    prompt = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    assert_last_logits_match(ours, hf, prompt)
    result = make_engine(ours).generate(greedy_requests([prompt], 30, ignore_eos=True))
    assert result[0].completions[0].token_ids == hf_greedy(hf, prompt, 30)
