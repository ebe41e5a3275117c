"""AQN on the offline default model (SmolLM2-135M-Instruct, Llama architecture, 30 layers, d = 576)."""

import aqn
import pytest
import torch
from aqn_test_helpers import (
    assert_bit_identical,
    scale_input_columns,
    snapshot,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm():
    nvfp4_offline = pytest.importorskip("nvfp4.offline")
    transformers = pytest.importorskip("transformers")
    try:
        path = nvfp4_offline.offline_default_model_path()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"offline default model unavailable: {e}")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return model, tok


@pytest.fixture(scope="module")
def prompt(smollm):
    _, tok = smollm
    msgs = [{"role": "user", "content": "What is 17 + 25? Answer briefly."}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def test_discovers_every_decoder_layer(smollm):
    model, _ = smollm
    groups, skipped = aqn.find_norm_linear_pairs(model, return_skipped=True)
    n_layers = model.config.num_hidden_layers
    assert len(groups) == 2 * n_layers == 60
    for i in range(n_layers):
        attn, mlp = groups[2 * i], groups[2 * i + 1]
        p = f"model.layers.{i}"
        assert attn.norm_name == f"{p}.input_layernorm"
        assert attn.linear_names == tuple(f"{p}.self_attn.{x}_proj" for x in "qkv")
        assert mlp.norm_name == f"{p}.post_attention_layernorm"
        assert mlp.linear_names == (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")
        assert attn.num_channels == mlp.num_channels == 576
    assert skipped == ["model.norm"]


def test_noise_changes_outputs_and_restore_is_bit_identical(smollm, prompt):
    model, tok = smollm
    snap = snapshot(model)
    noise = aqn.NormNoise(model)

    def greedy_scores():
        with torch.no_grad():
            out = model.generate(
                **prompt,
                max_new_tokens=6,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tok.eos_token_id,
            )
        return out.sequences, torch.stack(out.logits)

    with torch.no_grad():
        clean_forward = model(**prompt).logits
    seq0, logits0 = greedy_scores()
    with noise.apply(1e-2, seed=0, step=1):
        seq1, logits1 = greedy_scores()
    assert not torch.equal(logits0[0], logits1[0])  # the first generated token's logits move
    assert (logits0[0] - logits1[0]).abs().max() > 1e-2
    assert_bit_identical(model, snap)
    with torch.no_grad():  # exactly the clean model again
        assert torch.equal(model(**prompt).logits, clean_forward)
    _ = seq0, seq1


def test_equivalence_on_the_real_model(smollm, prompt):
    model, _ = smollm
    ids = prompt["input_ids"]
    noise = aqn.NormNoise(model)
    with torch.no_grad():
        with noise.apply(1e-3, seed=4) as h:
            noisy = model(input_ids=ids).logits
            z = {k: v.clone() for k, v in h.noise.items()}
        clean = model(input_ids=ids).logits
        snap = snapshot(model)
        scale_input_columns(model, noise.groups, z)  # in place (a deepcopy of 135M params is slow), undone below
        ref = model(input_ids=ids).logits
        model.load_state_dict(snap)
        assert_bit_identical(model, snap)
    assert (noisy - clean).abs().max() > 1e-3
    # SmolLM2 has norm weights as small as 1e-5, so 1 + Z/w reaches ~100: fp32 round-off grows accordingly
    torch.testing.assert_close(noisy, ref, rtol=1e-3, atol=1e-3)


def test_controller_on_the_offline_default(smollm, prompt):
    model, _ = smollm
    snap = snapshot(model)
    ctl = aqn.AQNController(aqn.make_schedule("exponential", 1e-2, 5e-4, 10, total_steps=20), seed=1)
    ids = prompt["input_ids"]
    with torch.no_grad():
        clean = model(input_ids=ids).logits[0, -1]
        for step in range(0, 20, 3):
            with ctl.rollout(model, step) as h:
                out = model(input_ids=ids).logits[0, -1]
            assert (h is None) == (step < 2)
            assert torch.equal(out, clean) == (h is None)
    assert_bit_identical(model, snap)
