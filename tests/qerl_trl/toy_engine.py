"""A rollout engine written the way a new one is (one file plus one line in ``qerl_trl.rollout.ENGINES``), for
``test_toy_engine.py``: greedy decoding by the policy itself, refusing sampling settings it would ignore."""

from __future__ import annotations

from typing import Any

import torch
from qerl_trl.rollout.base import RolloutEngine, generate_padded


class ToyRollout(RolloutEngine):
    """The policy's ``generate`` with ``do_sample=False``: every completion of a group is the same."""

    name = "toy"
    holds_generation_memory = True
    generations: list[int] = []  # rows generated per call (what the test checks)
    trainings: int = 0

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        super().check_config(cfg)
        if cfg.top_k not in (None, 0):
            raise ValueError("rollout_engine='toy' decodes greedily and cannot honour top_k")

    def before_train(self) -> None:
        ToyRollout.trainings += 1

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        gen = self.trainer.generation_config
        ToyRollout.generations.append(len(prompt_ids))

        def run(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                  max_new_tokens=gen.max_new_tokens, pad_token_id=gen.pad_token_id,
                                  eos_token_id=gen.eos_token_id)  # fmt: skip

        return generate_padded(self.trainer, prompt_ids, "toy_generate", run), None


class SamplingToyRollout(ToyRollout):
    """The toy engine reporting the logprobs of the tokens it picked, as vLLM does (``sampling_logprobs``): the trainer
    then runs TRL's importance-sampling correction on it. Records the steps whose adapter it was handed."""

    name = "toy-logprobs"
    sampling_logprobs = True
    synced: list[int] = []

    def sync_lora(self) -> None:
        SamplingToyRollout.synced.append(self.trainer.state.global_step)

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        gen, logits = self.trainer.generation_config, []
        ToyRollout.generations.append(len(prompt_ids))

        def run(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=gen.max_new_tokens, pad_token_id=gen.pad_token_id,
                                 eos_token_id=gen.eos_token_id, output_logits=True, return_dict_in_generate=True)  # fmt: skip
            logits.append(torch.stack(out.logits, 1))  # [B, new, vocab], before any logits processor
            return out.sequences

        ids = generate_padded(self.trainer, prompt_ids, "toy_generate", run)
        logps = (logits[0].float() / self.trainer.temperature).log_softmax(-1).cpu()
        return ids, [logps[i, torch.arange(len(c)), c].tolist() for i, c in enumerate(ids)]
