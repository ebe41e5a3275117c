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
