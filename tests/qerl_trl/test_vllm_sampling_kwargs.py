"""``qerl_trl.rollout.vllm.sampling_kwargs``: the trainer's sampling settings as vLLM ``SamplingParams`` keywords, with
``generation_kwargs`` from YAML or a JSON command line (token ids as strings) made what vLLM takes. No vLLM needed."""

from __future__ import annotations

from types import SimpleNamespace

from qerl_trl.rollout.vllm import sampling_kwargs


def test_generation_kwargs_logit_bias_from_json_gets_int_token_ids():
    gen = {"min_tokens": 4, "stop_token_ids": [7, 9], "logit_bias": {"7": 1, "9": -0.5}}
    args = SimpleNamespace(generation_kwargs=gen)
    trainer = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=None, min_p=None, repetition_penalty=1.0,
                              max_completion_length=48, args=args)  # fmt: skip
    sp = sampling_kwargs(trainer, 16)
    assert sp["logit_bias"] == {7: 1.0, 9: -0.5} and all(type(t) is int for t in sp["logit_bias"])
    assert sp | {"logit_bias": None} == {"n": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                         "repetition_penalty": 1.0, "max_tokens": 48, "min_tokens": 4,
                                         "stop_token_ids": [7, 9], "logit_bias": None}  # fmt: skip
    assert args.generation_kwargs["logit_bias"] == {"7": 1, "9": -0.5}  # the config itself is left as given
