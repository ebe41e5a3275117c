"""``nvfp4-quantize``: inputs it cannot quantize end in one line on stderr and exit code 2 (``--debug``: the exception)."""

from __future__ import annotations

import json
import shutil

import pytest
from nvfp4.cli import main


def _one_line_exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nvfp4-quantize: error: ") and "Traceback" not in err, err
    return err


def test_missing_path(tmp_path, capsys):
    err = _one_line_exit_2([str(tmp_path / "no-such-model")], capsys)
    assert "no such file or folder" in err and "no-such-model" in err
    with pytest.raises(ValueError, match="no such file"):
        main([str(tmp_path / "no-such-model"), "--debug"])


def test_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    assert "no config.json" in _one_line_exit_2([str(tmp_path)], capsys)


def test_already_quantized_checkpoint(tiny_model_dir, tmp_path, capsys):
    shutil.copytree(tiny_model_dir, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    err = _one_line_exit_2([str(tmp_path / "q")], capsys)
    assert "already quantized" in err and "compressed-tensors" in err


def test_mxfp4_takes_rtn_only(tiny_model_dir, capsys):
    err = _one_line_exit_2([str(tiny_model_dir), "--format", "mxfp4", "--method", "mse"], capsys)
    assert "--format mxfp4 supports --method rtn only" in err


def _hashes(root):
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}  # fmt: skip


def _tiny_llama(offline_model_path, folder):
    """A tiny random llama saved in ``folder`` with the offline model's tokenizer (its samples decode)."""
    import torch
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(offline_model_path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tok))).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_an_existing_output_is_never_replaced_without_overwrite(tiny_model_dir, tmp_path, capsys):
    """``--out`` naming a file, a path under a file, or a folder that holds a model: one line, exit 2, nothing on disk
    changed (it was replaced silently, or a traceback for a file)."""
    earlier = tmp_path / "earlier-nvfp4"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"earlier weights")
    (earlier / "config.json").write_text("{}")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    before = _hashes(tmp_path)
    err = _one_line_exit_2([str(tiny_model_dir), "--out", str(earlier)], capsys)
    assert "holds files already (config.json, model.safetensors)" in err and "--overwrite" in err, err
    assert "a file; expected a folder" in _one_line_exit_2([str(tiny_model_dir), "--out", str(a_file)], capsys)
    assert "is a file" in _one_line_exit_2([str(tiny_model_dir), "--out", str(a_file / "model")], capsys)
    assert _hashes(tmp_path) == before


@pytest.mark.parametrize("where", ["the model", "a folder above it"])
def test_overwrite_never_replaces_the_model_being_quantized(where, tiny_model_dir, tmp_path, capsys):
    """``nvfp4-quantize m --out m --overwrite`` (or ``--out`` a folder holding ``m``) quantized ``m`` and then swapped
    the checkpoint in where the source model (or the whole folder above it) had been: the dense model was deleted.
    Now one line, exit 2, before anything loads; nothing on disk changed."""
    model = tmp_path / "models" / "m"
    shutil.copytree(tiny_model_dir, model)
    before = _hashes(tmp_path)
    out = model if where == "the model" else model.parent
    err = _one_line_exit_2([str(model), "--out", str(out), "--overwrite"], capsys)
    assert "would replace the model being quantized" in err, err
    assert _hashes(tmp_path) == before


def test_overwrite_swaps_the_new_checkpoint_in_once_complete(offline_model_path, tmp_path):
    """``--overwrite``: the new checkpoint is written beside the old one and renamed into its place when complete."""

    model_dir = _tiny_llama(offline_model_path, tmp_path / "llama")
    earlier = tmp_path / "out"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"earlier weights")
    main([str(model_dir), "--method", "rtn", "--out", str(earlier), "--overwrite", "--max-new-tokens", "2"])
    saved = json.loads((earlier / "config.json").read_text())
    assert saved["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert (earlier / "model.safetensors").read_bytes() != b"earlier weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "out"]  # no .out.new-* / .out.old-* left behind


def test_missing_data_folder(tiny_model_dir, tmp_path, capsys):
    """``--data`` without GSM8K's train.jsonl / test.jsonl: one line naming the file (it was a traceback, after the
    tokenizer load)."""
    err = _one_line_exit_2([str(tiny_model_dir), "--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "o")],
                           capsys)  # fmt: skip
    assert "--data" in err and "test.jsonl" in err, err
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "test.jsonl").write_text("")
    err = _one_line_exit_2([str(tiny_model_dir), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                            "--method", "gptq"], capsys)  # fmt: skip
    assert "train.jsonl" in err, err


def test_quantize_with_method_keeps_the_format_of_calibrated_methods(tiny_model_dir):
    """``quantize_with_method(..., method="gptq", format="mxfp4")`` dropped the format and quantized to NVFP4; it now
    stops as ``NVFP4Config(format="mxfp4", method="gptq")`` does."""
    import torch
    from nvfp4.cli import quantize_with_method

    def tokenizer(text, **_):
        return {"input_ids": torch.tensor([[1, 2, 3]])}

    with pytest.raises(ValueError, match="MXFP4"):
        quantize_with_method(tiny_model_dir, "gptq", tokenizer, ["some text"], format="mxfp4")


def test_a_folder_without_tokenizer_files_says_so(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A checkpoint folder with weights but no tokenizer files ended in transformers' "Couldn't instantiate the backend
    tokenizer ... You need to have sentencepiece or tiktoken installed": installing them changed nothing. The line
    now says the folder holds no tokenizer and how to put one there."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _one_line_exit_2([str(tiny_model_dir), "--out", str(tmp_path / "o")], capsys)
    assert "cannot load its tokenizer" in err and "no tokenizer files in the folder" in err, err
    assert "tokenizer.json" in err and "save_pretrained" in err and "sentencepiece" not in err, err


def test_model_whose_tokenizer_cannot_load(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A checkpoint folder without tokenizer files, or a Hub id that cannot be reached: one line naming the model
    (it was transformers' OSError traceback)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _one_line_exit_2([str(tiny_model_dir), "--out", str(tmp_path / "o")], capsys)
    assert "cannot load its tokenizer" in err and str(tiny_model_dir) in err, err
    err = _one_line_exit_2(["no-such-org/no-such-model", "--out", str(tmp_path / "o")], capsys)
    assert "no-such-org/no-such-model" in err, err


def test_sample_of_a_base_model_without_chat_template(offline_model_path):
    """A base model's tokenizer has no chat template: the sample step raised ValueError after the checkpoint was
    written, so the run ended in a traceback without its model card (and, with --overwrite, never swapped the new
    checkpoint in). The prompt is now encoded as plain text."""
    import torch
    from nvfp4.cli import _sample
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(offline_model_path)
    tokenizer.chat_template = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tokenizer)))
    assert isinstance(_sample(model, tokenizer, "What is 12 + 7?", 2), str)


def test_overwrite_that_fails_leaves_the_earlier_checkpoint_and_no_partial_one(offline_model_path, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """``--overwrite`` whose run fails after the new checkpoint was written (here the sample): the earlier checkpoint
    stays, and the new one's hidden ``.out.new-*`` folder (a whole checkpoint) was left behind; it is removed."""
    import nvfp4.cli

    model_dir = _tiny_llama(offline_model_path, tmp_path / "llama")
    earlier = tmp_path / "out"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"earlier weights")

    def fail(*args, **kwargs):
        raise RuntimeError("sample failed")

    monkeypatch.setattr(nvfp4.cli, "_sample", fail)
    with pytest.raises(RuntimeError, match="sample failed"):
        main([str(model_dir), "--method", "rtn", "--out", str(earlier), "--overwrite", "--max-new-tokens", "2"])
    assert (earlier / "model.safetensors").read_bytes() == b"earlier weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "out"]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_new_tokens_below_1_is_one_line_before_anything_is_written(tiny_model_dir, tmp_path, capsys, value):
    """``--max-new-tokens 0`` was a transformers traceback after quantizing and saving, which left a checkpoint
    without its model card; now one line before anything loads, and no folder."""
    out = tmp_path / "out"
    err = _one_line_exit_2([str(tiny_model_dir), "--out", str(out), "--max-new-tokens", value], capsys)
    assert f"--max-new-tokens must be >= 1, got {value}" in err
    assert not out.exists()


def test_a_model_path_under_home_written_with_a_tilde_is_found(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """``nvfp4-quantize '~/models/m'`` (quoted, or from Python) said "no such file or folder" for a folder that
    exists: ``~`` counted as a local path but was never expanded (``--out`` and ``--data`` are). It now gets as far as
    the folder allows (this one has no tokenizer)."""
    monkeypatch.setenv("HOME", str(tiny_model_dir.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _one_line_exit_2([f"~/{tiny_model_dir.name}", "--out", str(tmp_path / "o")], capsys)
    assert "no such file" not in err and "cannot load its tokenizer" in err, err


def test_a_run_that_fails_after_saving_leaves_no_partial_checkpoint(offline_model_path, tmp_path, monkeypatch):
    """A run into a new ``--out`` that fails (or is interrupted) after the checkpoint was written (here the sample)
    left a checkpoint without its model card at ``--out``, which the next run then refused to replace without
    ``--overwrite``; the checkpoint is now written beside ``--out`` and moved there once complete, as with
    ``--overwrite``."""
    import nvfp4.cli

    model_dir = _tiny_llama(offline_model_path, tmp_path / "llama")

    def fail(*args, **kwargs):
        raise RuntimeError("sample failed")

    monkeypatch.setattr(nvfp4.cli, "_sample", fail)
    with pytest.raises(RuntimeError, match="sample failed"):
        main([str(model_dir), "--method", "rtn", "--out", str(tmp_path / "new" / "out"), "--max-new-tokens", "2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "new"] and not any((tmp_path / "new").iterdir())
    monkeypatch.undo()
    main([str(model_dir), "--method", "rtn", "--out", str(tmp_path / "new" / "out"), "--max-new-tokens", "2"])
    assert (tmp_path / "new" / "out" / "README.md").is_file() and len(list((tmp_path / "new").iterdir())) == 1


def test_push_to_hub_while_the_hub_is_offline_is_one_line_before_anything_loads(tiny_model_dir, tmp_path, capsys,
                                                                                 monkeypatch):  # fmt: skip
    """``--push-to-hub REPO`` with ``HF_HUB_OFFLINE=1`` quantized, measured and saved, then ended in huggingface_hub's
    traceback at the push; now one line before anything loads."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    err = _one_line_exit_2([str(tiny_model_dir), "--out", str(out), "--push-to-hub", "me/model"], capsys)
    assert "--push-to-hub 'me/model'" in err and "HF_HUB_OFFLINE" in err, err
    assert not out.exists()


def test_a_config_json_that_is_not_json_is_one_line(tmp_path, capsys):
    """A checkpoint folder whose config.json is cut short (or not JSON) was a JSONDecodeError traceback."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", ')
    err = _one_line_exit_2([str(tmp_path / "m"), "--out", str(tmp_path / "o")], capsys)
    assert "config.json" in err and "not readable JSON" in err, err


@pytest.mark.parametrize("row", ['{"problem": "1+1?", "solution": "2"}', '{"question": "1+1?", "answer": "2"'])
def test_data_rows_that_are_not_gsm8k_are_one_line_before_the_model_loads(row, tiny_model_dir, tmp_path, capsys):
    """``--data`` whose jsonl rows are another dataset's (MATH's problem/solution) or not JSON ended in a KeyError or
    JSONDecodeError traceback after the tokenizer had loaded; now one line naming the file and the line."""
    data = tmp_path / "d"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(row + "\n")
    err = _one_line_exit_2([str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "o")], capsys)
    assert "--data" in err and "test.jsonl: line 1: not a GSM8K row" in err, err


def test_version_names_the_package_and_what_it_runs_on(capsys):
    """``nvfp4-quantize --version`` was "unrecognized arguments: --version"."""
    import importlib.metadata as md

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    out = capsys.readouterr().out.splitlines()
    assert exit_info.value.code == 0 and out[0] == f"nvfp4 {md.version('nvfp4')}" and out[1].startswith("torch ")


def test_a_model_given_as_dot_is_named_by_its_folder(offline_model_path, tmp_path, monkeypatch):
    """``nvfp4-quantize .`` (run inside the model's folder) saved to runs/-nvfp4 and wrote a model card titled
    '#  — NVFP4' with an empty base_model; the folder's own name is used now."""

    model_dir = _tiny_llama(offline_model_path, tmp_path / "llama")
    monkeypatch.chdir(model_dir)
    main([".", "--method", "rtn", "--max-new-tokens", "1"])
    card = (model_dir / "runs" / "llama-nvfp4" / "README.md").read_text()
    assert "base_model: llama\n" in card and "# llama — NVFP4" in card


def test_a_folder_without_whole_weights_is_one_line(tiny_model_dir, tmp_path, capsys):
    """A model folder without weights (a download that stopped after config.json) ended in transformers' 'no file
    named model.safetensors' OSError traceback, one whose model.safetensors is cut short in safetensors' 'incomplete
    metadata' traceback, both after the tokenizer loaded; now one line naming the folder and the file."""
    none = tmp_path / "no-weights"
    none.mkdir()
    shutil.copy(tiny_model_dir / "config.json", none)
    err = _one_line_exit_2([str(none), "--out", str(tmp_path / "o")], capsys)
    assert f"model {str(none)!r}: no weights" in err and "model.safetensors" in err, err
    cut = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = _one_line_exit_2([str(cut), "--out", str(tmp_path / "o")], capsys)
    assert f"model {str(cut)!r}: model.safetensors is not a complete safetensors file" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("repo", ["my model", "me/my/model", "me/model-", "me/" + "m" * 100])
def test_a_push_to_hub_repo_that_is_no_repo_id_is_one_line_before_anything_loads(repo, tiny_model_dir, tmp_path,
                                                                                  capsys):  # fmt: skip
    """``--push-to-hub 'my model'`` quantized, measured and saved, then ended in huggingface_hub's HFValidationError
    traceback at the push; now one line naming the option, the value and the form a repo id takes."""
    out = tmp_path / "out"
    err = _one_line_exit_2([str(tiny_model_dir), "--out", str(out), "--push-to-hub", repo], capsys)
    assert f"--push-to-hub {repo!r}: not a Hub repo id" in err, err
    assert not out.exists()


def test_perplexity_data_without_a_train_split_is_enough_for_uncalibrated_methods(offline_model_path, gsm8k_dir,
                                                                                  tmp_path, capsys):  # fmt: skip
    """``--data`` with test.jsonl only (what perplexity reads) was refused for --method rtn / mse ('no train.jsonl
    there'), though only awq / gptq calibrate on train.jsonl; it now measures perplexity, and a calibrated method
    still asks for train.jsonl."""

    model_dir = _tiny_llama(offline_model_path, tmp_path / "llama")
    data = tmp_path / "gsm8k-test"
    data.mkdir()
    shutil.copy(gsm8k_dir / "test.jsonl", data)
    main([str(model_dir), "--method", "rtn", "--data", str(data), "--n-eval", "2", "--out", str(tmp_path / "o"),
          "--max-new-tokens", "1"])  # fmt: skip
    assert "GSM8K ppl" in capsys.readouterr().out
    err = _one_line_exit_2([str(model_dir), "--method", "awq", "--data", str(data), "--out", str(tmp_path / "o2")],
                           capsys)  # fmt: skip
    assert "no train.jsonl" in err, err


def test_the_package_readme_documents_every_option(capsys):
    """``packages/nvfp4/README.md`` (the wheel's description: what ``pip show`` / PyPI give someone who installs only
    ``nvfp4``) was the title alone, so nothing said how to use the package by itself. It now documents every
    ``nvfp4-quantize`` option and every ``NVFP4Config`` argument."""
    import inspect
    import re
    from pathlib import Path

    from nvfp4 import NVFP4Config

    readme = (Path(__file__).parents[2] / "packages" / "nvfp4" / "README.md").read_text()
    with pytest.raises(SystemExit):
        main(["--help"])
    flags = set(re.findall(r"--[a-z][a-z-]+", capsys.readouterr().out)) - {"--help"}
    args = [p for p in inspect.signature(NVFP4Config).parameters if p != "kwargs"]
    assert flags and args
    assert [f for f in sorted(flags) if f not in readme] == []
    assert [a for a in args if f"{a}=" not in readme] == []
    for name in ("nvfp4-quantize", "from_compressed_tensors", "load_nvfp4_checkpoint", "quantize_model", "MXFP4Config",
                 "nvfp4.peft", "compressed-tensors"):  # fmt: skip
        assert name in readme, name


def _unannotated(module) -> list[str]:
    """The parameters and returns of ``module.__all__``'s functions (and public methods) without a type hint."""
    import inspect

    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        funcs = [(name, obj)] if inspect.isfunction(obj) else [
            (f"{name}.{m}", f) for m, f in vars(obj).items() if inspect.isfunction(f) and not m.startswith("_")
        ] if inspect.isclass(obj) else []  # fmt: skip
        for label, f in funcs:
            sig = inspect.signature(f)
            missing += [f"{label}({p})" for p in sig.parameters.values()
                        if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]  # fmt: skip
            if sig.return_annotation is inspect.Signature.empty:
                missing.append(f"{label} -> ?")
    return missing


def test_the_public_functions_of_the_cli_and_its_evaluation_have_type_hints():
    """``calibration_ids(tokenizer, ...)``, ``quantize_with_method(..., tokenizer=None, ...)`` (no return type either)
    and ``perplexity(model, tokenizer, ...)`` left the tokenizer unannotated: an IDE or a type checker could not tell
    a tokenizer from its name, nor what quantize_with_method returns."""
    import nvfp4.cli
    import nvfp4.evaluate

    assert _unannotated(nvfp4.cli) + _unannotated(nvfp4.evaluate) == []


def test_help_gives_the_default_out_folder_of_each_format(capsys):
    """``--help`` said ``--out`` defaults to ``runs/<name>-nvfp4``, but ``--format mxfp4`` saves to
    ``runs/<name>-mxfp4``; it now names the format in the default."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "runs/<name>-<format>" in text and "runs/<name>-nvfp4" not in text
