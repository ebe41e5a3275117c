"""Generation settings every rollout engine must either honour or refuse when the config is built (``QeRLConfig``
calls the engine's ``check_config``): a TRL setting that one engine applies and another silently drops makes the run
differ from what its config says."""

from __future__ import annotations

import pytest
from qerl_trl.config import QeRLConfig

ENGINES = ["transformers", "graph", "vllm"]


@pytest.mark.parametrize("engine", ENGINES)
def test_use_vllm_is_refused_by_every_engine(engine):
    # TRL's own vLLM path merges the LoRA adapter into the 4-bit base; the transformers engine would enter it
    with pytest.raises(ValueError, match="use_vllm"):
        QeRLConfig(output_dir="x", rollout_engine=engine, use_vllm=True)


@pytest.mark.parametrize("engine", ["graph", "vllm"])
def test_vespo_with_sequence_level_correction_is_refused(engine):
    # TRL refuses it under its use_vllm flag, which the trainer sets only after TRL's __init__ checked: refused here
    for mode in ("sequence_mask", "sequence_truncate"):
        with pytest.raises(ValueError, match="vespo"):
            QeRLConfig(output_dir="x", rollout_engine=engine, loss_type="vespo",
                       vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode)  # fmt: skip
    QeRLConfig(output_dir="x", rollout_engine=engine, loss_type="vespo", vllm_importance_sampling_correction=True,
               vllm_importance_sampling_mode="token_mask")  # fmt: skip
    QeRLConfig(output_dir="x", rollout_engine=engine, loss_type="vespo", vllm_importance_sampling_correction=False,
               vllm_importance_sampling_mode="sequence_mask")  # fmt: skip


def test_transformers_refuses_generation_kwargs_generate_ignores():
    # GenerationConfig keeps any key as an attribute and generate() never reads it: vLLM's spelling of a setting
    # (min_tokens, stop) would be dropped without a word, while the vLLM engine applies it
    for bad in ({"min_tokens": 4}, {"stop": ["\n\n"]}, {"min_new_tokens": 2, "ignore_eos": True}):
        with pytest.raises(ValueError, match=next(k for k in bad if k != "min_new_tokens")):
            QeRLConfig(output_dir="x", rollout_engine="transformers", generation_kwargs=bad)
    QeRLConfig(output_dir="x", rollout_engine="transformers",
               generation_kwargs={"min_new_tokens": 4, "max_cache_len": 64, "no_repeat_ngram_size": 3,
                                  "suppress_tokens": [3]})  # fmt: skip


def test_transformers_refuses_stop_strings_up_front():
    # generate() needs a tokenizer for stop strings, which TRL's call does not pass: it raised at the first step
    with pytest.raises(ValueError, match="stop_strings"):
        QeRLConfig(output_dir="x", rollout_engine="transformers", generation_kwargs={"stop_strings": ["\n\n"]})


@pytest.mark.parametrize("engine", ["transformers", "graph"])
def test_structured_outputs_regex_is_refused_where_not_applied(engine):
    # TRL's vllm_structured_outputs_regex constrains vLLM's sampling; these engines have nothing that applies it
    with pytest.raises(ValueError, match="vllm_structured_outputs_regex"):
        QeRLConfig(output_dir="x", rollout_engine=engine, vllm_structured_outputs_regex=r"\d+")


def test_vllm_engine_applies_structured_outputs_regex():
    from types import SimpleNamespace

    from qerl_trl.rollout.vllm import sampling_kwargs

    cfg = QeRLConfig(output_dir="x", rollout_engine="vllm", vllm_structured_outputs_regex=r"\d+",
                     generation_kwargs={"structured_outputs": {"choice": ["a"]}, "min_tokens": 2})  # fmt: skip
    trainer = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=None, min_p=None, repetition_penalty=1.0,
                              max_completion_length=8, args=cfg)  # fmt: skip
    sp = sampling_kwargs(trainer, 4)
    assert sp["structured_outputs"] == {"regex": r"\d+"} and sp["min_tokens"] == 2  # the regex wins, as in TRL
    assert cfg.generation_kwargs["structured_outputs"] == {"choice": ["a"]}  # the config is left as given


@pytest.mark.parametrize("server_url", [None, "http://127.0.0.1:8000"])
def test_vllm_refuses_transformers_generation_kwargs(server_url):
    # transformers' names for what the other engines apply: a vLLM server drops unknown request fields silently
    for bad in ({"max_new_tokens": 8}, {"min_new_tokens": 4}, {"do_sample": False}, {"no_repeat_ngram_size": 3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QeRLConfig(output_dir="x", rollout_engine="vllm", vllm={"server_url": server_url}, generation_kwargs=bad)
    QeRLConfig(output_dir="x", rollout_engine="vllm", vllm={"server_url": server_url},
               generation_kwargs={"min_tokens": 2, "stop_token_ids": [3], "top_p": 0.9, "seed": 1})  # fmt: skip


def test_vllm_refuses_transformers_continuous_batching():
    # continuous batching is the transformers engine's way to generate; the vLLM engine would ignore the switch
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        QeRLConfig(output_dir="x", rollout_engine="vllm", use_transformers_continuous_batching=True)


def test_vllm_refuses_n_in_generation_kwargs():
    # the engine sends each group of num_generations rows once with n=num_generations: another n breaks the row count
    with pytest.raises(ValueError, match="num_generations"):
        QeRLConfig(output_dir="x", rollout_engine="vllm", generation_kwargs={"n": 2})


def test_transformers_refuses_num_return_sequences():
    # generate() would return k rows per prompt row: the completions no longer line up with TRL's prompts
    with pytest.raises(ValueError, match="num_return_sequences"):
        QeRLConfig(output_dir="x", rollout_engine="transformers", generation_kwargs={"num_return_sequences": 2})
    QeRLConfig(output_dir="x", rollout_engine="transformers", generation_kwargs={"num_return_sequences": 1})


def test_transformers_refuses_vllms_no_top_k_up_front():
    # top_k=-1 is "no top-k" for vLLM and the graph engine; transformers' generate raised on it at the first step
    for kw in ({"top_k": -1}, {"generation_kwargs": {"top_k": -1}}):
        with pytest.raises(ValueError, match="top_k=0"):
            QeRLConfig(output_dir="x", rollout_engine="transformers", **kw)
    QeRLConfig(output_dir="x", rollout_engine="transformers", top_k=0)
    QeRLConfig(output_dir="x", rollout_engine="transformers", top_k=20)


def test_vllm_lora_tiles_are_checked_with_the_config(tmp_path):
    """``vllm.lora_tiles`` (:mod:`qerl_vllm.lora_tiles`) is refused in one line before a model loads: a name the
    engine does not know, and any choice but the default in server mode (the server's tiles are its own)."""
    from qerl_trl.cli import parse_train_args

    assert QeRLConfig(output_dir="x", rollout_engine="vllm").vllm.lora_tiles == "tuned"
    refusals = [
        ({"lora_tiles": "fast"}, r"^vllm.lora_tiles must be one of 'tuned', 'stock', 'reproducible', got 'fast'$"),
        ({"lora_tiles": "reproducible", "server_url": "http://127.0.0.1:1"},
         r"^vllm.lora_tiles sets the colocated engine; a server's LoRA tiles are its own VLLM_TUNED_CONFIG_FOLDER"),
    ]  # fmt: skip
    for vllm, message in refusals:
        with pytest.raises(ValueError, match=message) as info:
            QeRLConfig(output_dir="x", rollout_engine="vllm", vllm=vllm)
        assert "\n" not in str(info.value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: offline-default\nrollout_engine: vllm\nvllm: {lora_tiles: reproducible}\n")
    assert parse_train_args([str(recipe)])[1].vllm.lora_tiles == "reproducible"
