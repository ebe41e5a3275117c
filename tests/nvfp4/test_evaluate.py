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
