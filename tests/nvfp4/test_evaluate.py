"""``nvfp4.evaluate.perplexity``: texts too short to score (one token: nothing to predict) end in one line."""

from __future__ import annotations

import math

import pytest
import torch
from nvfp4.evaluate import perplexity
from tiny_models import tiny_config


@pytest.fixture(scope="module")
def model_and_tokenizer(offline_model_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(offline_model_path)
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config("llama", vocab_size=len(tok))).eval(), tok


def test_perplexity_of_texts_with_nothing_to_predict_is_one_line(model_and_tokenizer):
    """One-token texts give no next token to score: their perplexity is undefined (it divided 0 by 0 tokens:
    ``ZeroDivisionError``); mixed with a longer text they add nothing, and the longer text is scored."""
    model, tok = model_and_tokenizer
    one_token = "Hello"
    assert len(tok(one_token).input_ids) == 1
    with torch.no_grad():
        for texts in ([one_token], [one_token, one_token], []):
            with pytest.raises(ValueError, match=r"^perplexity: none of the \d+ texts has 2 or more tokens") as info:
                perplexity(model, tok, texts, progress=False)
            assert "\n" not in str(info.value)
        longer = "Hello there, how are you today?"
        ppl = perplexity(model, tok, [one_token, longer], progress=False)
        assert math.isfinite(ppl) and ppl == pytest.approx(perplexity(model, tok, [longer], progress=False))


def test_errors_of_a_model_carrying_lora_adapters_are_those_of_its_4bit_base():
    """``weight_relative_error`` / ``output_relative_error`` matched each 4-bit layer to the dense model by its name in
    the quantized model: under PEFT ('base_model.model.….q_proj.base_layer') that name is in no dense model, a bare
    KeyError. The layers are now matched by their name in the base model: the same errors as without the adapters."""
    from nvfp4 import quantize_model
    from nvfp4.evaluate import output_relative_error, weight_relative_error
    from nvfp4.peft import get_peft_model
    from peft import LoraConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    dense = LlamaForCausalLM(tiny_config("llama")).eval()
    torch.manual_seed(0)
    quantized = quantize_model(LlamaForCausalLM(tiny_config("llama")).eval(), progress=False)
    batches = [torch.randint(0, 256, (1, 8))]
    with torch.no_grad():
        weights, outputs = weight_relative_error(dense, quantized), output_relative_error(dense, quantized, batches)
        peft = get_peft_model(quantized, LoraConfig(r=4, target_modules=["q_proj"]))  # zero-initialised B: same outputs
        assert weight_relative_error(dense, peft) == weights
        assert output_relative_error(dense, peft, batches) == outputs
