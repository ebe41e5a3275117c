"""transformers integration: quantize on load, generate, save/reload identity, llm-compressor checkpoints, bad files."""

from __future__ import annotations

import json
import shutil

import nvfp4
import pytest
import torch
from nvfp4 import NVFP4Config, NVFP4Linear
from nvfp4.hf import QUANT_METHOD, NVFP4CheckpointError
from transformers import AutoModelForCausalLM, AutoTokenizer


def _state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if set(sa) != set(sb):
        return False
    view = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return all(torch.equal(view(sa[k]), view(sb[k])) for k in sa)


def _round_trip(path, tmp_path, ids):
    m = AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4Config())
    assert any(isinstance(x, NVFP4Linear) for x in m.modules())
    out = m.generate(ids, max_new_tokens=8, do_sample=False)
    m.save_pretrained(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"  # what llm-compressor writes
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert cfg["quantization_config"]["qerl"]["method"] == "rtn"
    m2 = nvfp4.from_compressed_tensors(tmp_path / "q")
    assert all(type(a) is type(b) for a, b in zip(m.modules(), m2.modules()))
    assert _state_equal(m, m2)
    assert torch.equal(m2.generate(ids, max_new_tokens=8, do_sample=False), out)
    return m, m2


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2"], indirect=True)
def test_tiny_round_trip(tiny_model_dir, tmp_path):
    m, _ = _round_trip(tiny_model_dir, tmp_path, torch.randint(0, 256, (2, 6)))
    q = m.model.layers[0].self_attn
    assert q.q_proj.weight_global_scale.item() == q.v_proj.weight_global_scale.item()
    # quantize-on-load gives exactly what quantize_model gives on the dense model
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    nvfp4.quantize_model(dense, progress=False)
    assert _state_equal(m, dense)


def test_offline_default_round_trip(offline_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(offline_model_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    m, _ = _round_trip(offline_model_path, tmp_path, ids)
    assert sum(isinstance(x, NVFP4Linear) for x in m.modules()) == 30 * 7
    size_q = (tmp_path / "q" / "model.safetensors").stat().st_size
    size_d = (offline_model_path / "model.safetensors").stat().st_size
    assert size_q < 0.5 * size_d


def _llm_compressor_checkpoint(tiny_model_dir, ct_dir, quantized, targets) -> dict:
    """``tiny_model_dir`` laid out in ``ct_dir`` as llm-compressor's NVFP4A16 writes it (compressed-tensors config and
    tensors), the ``*_proj.weight`` tensors that ``quantized(name)`` accepts compressed, the config group's
    ``targets`` as given; returns the saved tensors."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    dense = load_file(tiny_model_dir / "model.safetensors")
    out = {}
    for k, w in dense.items():
        if k.endswith("_proj.weight") and quantized(k):
            base = k[: -len(".weight")]
            gs = generate_gparam(w.float().amin(), w.float().amax())
            blk = w.reshape(w.shape[0], -1, 16)
            s, _ = calculate_qparams(blk.amin(-1), blk.amax(-1), scheme.weights, global_scale=gs)
            c = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": s, "weight_global_scale": gs}, scheme)
            out.update({f"{base}.{n}": t for n, t in c.items()})
        else:
            out[k] = w
    shutil.copytree(tiny_model_dir, ct_dir)
    save_file(out, ct_dir / "model.safetensors")
    cfg = json.loads((ct_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": targets, "weights": {
            "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group"}}},
    }  # fmt: skip
    (ct_dir / "config.json").write_text(json.dumps(cfg))
    return out


def test_llm_compressor_checkpoint_loads(tiny_model_dir, tmp_path):
    """A folder laid out as llm-compressor's NVFP4A16 writes it (compressed-tensors config + same tensors)."""
    ct_dir = tmp_path / "ct"
    out = _llm_compressor_checkpoint(tiny_model_dir, ct_dir, lambda name: True, ["Linear"])
    m = nvfp4.from_compressed_tensors(ct_dir)
    q = m.model.layers[1].mlp.down_proj
    assert isinstance(q, NVFP4Linear)
    assert torch.equal(q.weight_packed, out["model.layers.1.mlp.down_proj.weight_packed"])
    assert torch.isfinite(m(input_ids=torch.randint(0, 256, (1, 5))).logits).all()


@pytest.mark.parametrize(
    "targets", [[r"re:.*mlp.*"], [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")]]
)
def test_llm_compressor_checkpoint_targeting_some_linears_loads_the_others_dense(tiny_model_dir, tmp_path, targets):
    """llm-compressor quantizes only the linears its config group ``targets`` (a ``re:`` regex, applied with
    ``re.match``, or exact names); the others are saved dense. Loading read every linear as NVFP4 ("their tensors are
    absent")."""
    ct_dir = tmp_path / "ct"
    out = _llm_compressor_checkpoint(tiny_model_dir, ct_dir, lambda name: ".mlp." in name, targets)
    m = nvfp4.from_compressed_tensors(ct_dir)
    layers = m.model.layers
    assert {type(layers[1].mlp.down_proj), type(layers[0].mlp.gate_proj)} == {NVFP4Linear}
    assert torch.equal(layers[1].mlp.down_proj.weight_packed, out["model.layers.1.mlp.down_proj.weight_packed"])
    q = layers[1].self_attn.q_proj
    assert type(q) is torch.nn.Linear and torch.equal(q.weight, out["model.layers.1.self_attn.q_proj.weight"])
    assert torch.isfinite(m(input_ids=torch.randint(0, 256, (1, 5))).logits).all()
    m.save_pretrained(tmp_path / "again")  # the saved config keeps the dense linears dense for every reader
    ignore = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["ignore"]
    # by exact name: a regex naming the untargeted linears also matches the fused names vLLM checks first
    # (model.layers.0.mlp.gate_up_proj, which is no target), and stock vLLM kept the quantized gate/up dense
    assert "model.layers.1.self_attn.q_proj" in ignore and not any(p.startswith("re:(?!") for p in ignore)
    again = nvfp4.from_compressed_tensors(tmp_path / "again")
    assert type(again.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    assert type(again.model.layers[1].mlp.down_proj) is NVFP4Linear


def test_truncated_safetensors_fails_clearly(tiny_model_dir, tmp_path):
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config())
    m.save_pretrained(tmp_path / "q")
    f = tmp_path / "q" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(NVFP4CheckpointError, match="truncated"):
        nvfp4.from_compressed_tensors(tmp_path / "q")
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(NVFP4CheckpointError, match="not a readable safetensors"):
        nvfp4.from_compressed_tensors(tmp_path / "q")


def test_config_disagreeing_with_tensors_fails_clearly(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    for serialization in (QUANT_METHOD, "compressed-tensors"):  # claims NVFP4 but the tensors are dense
        cfg["quantization_config"] = NVFP4Config(serialization=serialization).to_dict()
        (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(NVFP4CheckpointError, match="disagrees with the tensors"):
            nvfp4.load_nvfp4_checkpoint(tmp_path / "d")


def test_config_validation_and_serialisation(tiny_model_dir):
    for method in ("awq", "gptq"):  # calibrated methods on a dense checkpoint need data
        with pytest.raises(ValueError, match="needs calibration_data"):
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(method=method))
    with pytest.raises(ValueError, match="method"):
        NVFP4Config(method="hqq")
    with pytest.raises(ValueError, match="takes no calibration_data"):
        NVFP4Config(method="rtn", calibration_data=[torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="token ids"):
        AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, quantization_config=NVFP4Config(method="gptq", calibration_data=[torch.rand(4)])
        )
    with pytest.raises(ValueError, match="choose one of"):
        NVFP4Config(format="int4-pack-quantized")
    with pytest.raises(ValueError, match="serialization"):
        NVFP4Config(serialization="nvfp4")
    d = NVFP4Config(method="mse", serialization=QUANT_METHOD).to_dict()
    assert d["quant_method"] == QUANT_METHOD and d["method"] == "mse" and d["modules_to_not_convert"] == ["lm_head"]
    ct = NVFP4Config(method="mse").to_dict()
    assert ct["quant_method"] == "compressed-tensors" and ct["ignore"] == ["lm_head"] and ct["qerl"]["method"] == "mse"
    back = NVFP4Config.from_compressed_tensors_dict(ct)
    assert (back.method, back.modules_to_not_convert, back.fused_groups) == ("mse", ["lm_head"], NVFP4Config().fused_groups)
    with pytest.raises(NVFP4CheckpointError, match="W4A4"):
        NVFP4Config.from_compressed_tensors_dict(
            ct | {"config_groups": {"g": ct["config_groups"]["group_0"] | {"input_activations": {"num_bits": 4}}}}
        )
    assert QUANT_METHOD != "nvfp4"  # transformers owns that name


@pytest.mark.parametrize("serialization", ["compressed-tensors", QUANT_METHOD])
@pytest.mark.parametrize("format", ["nvfp4", "mxfp4"])
def test_config_from_dict_gives_back_the_config_to_dict_wrote(serialization, format):
    """``NVFP4Config.from_dict(cfg.to_dict())`` (transformers' own pair) read the default, compressed-tensors dict as
    keyword arguments: method, format and modules_to_not_convert fell back to their defaults ('mse' became 'rtn',
    'mxfp4' 'nvfp4', the ignore list ['lm_head']) and the whole compressed-tensors dict was nested under "qerl" as
    unknown options. It now reads that dict as :meth:`NVFP4Config.from_compressed_tensors_dict` does."""
    method = "mse" if format == "nvfp4" else "rtn"
    cfg = NVFP4Config(method=method, modules_to_not_convert=["lm_head", "re:.*mlp.down_proj"], fused_groups=[],
                      format=format, serialization=serialization)  # fmt: skip
    back = NVFP4Config.from_dict(cfg.to_dict())
    assert (back.method, back.weight_format, back.modules_to_not_convert, back.fused_groups, back.extra) == (
        method, cfg.weight_format, cfg.modules_to_not_convert, [], {}
    )
    if serialization == "compressed-tensors":
        assert back.to_dict() == cfg.to_dict()


def test_old_config_checkpoint_still_loads(tiny_model_dir, tmp_path):
    """Checkpoints written with the previous ``nvfp4_w4a16`` config load through ``from_pretrained`` (and
    :func:`nvfp4.load_nvfp4_checkpoint`), bit for bit what the new config loads."""
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(serialization=QUANT_METHOD))
    m.save_pretrained(tmp_path / "old")
    assert json.loads((tmp_path / "old" / "config.json").read_text())["quantization_config"]["quant_method"] == QUANT_METHOD
    m.config.quantization_config.serialization = "compressed-tensors"
    m.save_pretrained(tmp_path / "new")
    for loaded in (AutoModelForCausalLM.from_pretrained(tmp_path / "old"), nvfp4.load_nvfp4_checkpoint(tmp_path / "old"),
                   nvfp4.load_nvfp4_checkpoint(tmp_path / "new")):  # fmt: skip
        assert isinstance(loaded.model.layers[0].mlp.up_proj, NVFP4Linear)
        assert _state_equal(m, loaded)
    assert nvfp4.hf.nvfp4_checkpoint_kind(tiny_model_dir) is None
    with pytest.raises(NVFP4CheckpointError, match="not an NVFP4 checkpoint"):
        nvfp4.load_nvfp4_checkpoint(tiny_model_dir)


# Run in a fresh interpreter that never imports nvfp4: stock transformers (+ compressed-tensors) loads our checkpoint.
_STOCK_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)  # compressed-tensors decompresses to bf16
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(ids).logits
assert "nvfp4" not in sys.modules
torch.save(logits, sys.argv[3])
"""


def _site_packages_without(tmp_path, *prefixes: str):
    """A folder of links to every entry of this interpreter's site-packages except those starting with
    ``prefixes``: run with ``python -S`` and it on PYTHONPATH, the packages are absent as on a machine without them."""
    import site

    src = next(p for p in map(__import__("pathlib").Path, site.getsitepackages()) if (p / "transformers").is_dir())
    view = tmp_path / "site-packages"
    view.mkdir()
    for entry in src.iterdir():
        if not entry.name.startswith(prefixes):
            (view / entry.name).symlink_to(entry)
    return view


def test_saved_checkpoint_loads_in_stock_transformers(tiny_model_dir, tmp_path):
    """The checkpoint we save loads in a process without ``import nvfp4`` (transformers + compressed-tensors) with
    logits equal to our ``NVFP4Linear`` model's within bf16 rounding; without compressed-tensors installed the load
    fails with an error that names it (never a model with random linears)."""
    import subprocess
    import sys

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    m.save_pretrained(tmp_path / "q")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = m(ids).logits
    out = tmp_path / "stock.pt"
    args = [sys.executable, "-c", _STOCK_LOAD, str(tmp_path / "q"), json.dumps(ids.tolist()), str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = torch.load(out)
    assert torch.isfinite(stock).all()
    rel = ((stock.float() - ours.float()).norm() / ours.float().norm()).item()
    assert rel < 1e-2, f"stock transformers decoded other weights than ours (relative logit error {rel:.2e})"

    view = _site_packages_without(tmp_path, "compressed_tensors", "compressed-tensors", "_nvfp4", "nvfp4", "__editable__")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(view)}
    proc = subprocess.run([sys.executable, "-S", *args[1:]], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and not out.with_suffix(".none").exists()
    assert "compressed-tensors" in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


_STOCK_LOAD_DTYPES = """
import sys, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([[1, 2, 3]])
for dtype in (None, torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **({"dtype": dtype} if dtype else {}))
    try:
        with torch.no_grad():
            model(ids)
        print(dtype, "ok")
    except RuntimeError as e:
        print(dtype, "fails:", str(e).splitlines()[0])
"""


def test_saving_a_float32_checkpoint_warns_that_stock_loads_need_bf16(tiny_model_dir, tmp_path):
    """compressed-tensors 0.20 decompresses FP4 weights to bf16: a float32 checkpoint of ours loads in stock
    transformers but its first forward fails unless the load asks for bf16. Our save says so; a bf16 save does not."""
    import subprocess
    import sys
    import warnings

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(), dtype=torch.float32)
    with pytest.warns(UserWarning, match="dense tensors are float32: compressed-tensors decompresses FP4 weights"):
        m.save_pretrained(tmp_path / "fp32")
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bf16.save_pretrained(tmp_path / "bf16")
    proc = subprocess.run([sys.executable, "-c", _STOCK_LOAD_DTYPES, str(tmp_path / "fp32")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("None fails: expected m1 and m2 to have the same dtype") and lines[1] == "torch.bfloat16 ok"


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_method_on_load_saves_and_reloads(tiny_model_dir, tmp_path, method):
    """``NVFP4Config(method=awq|gptq, calibration_data=...)``: every linear quantized, fused groups keep one global
    scale, the data is not saved (its count is), and the checkpoint reloads to the same tensors and logits."""
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (int(torch.randint(5, 20, (1,), generator=gen)),), generator=gen) for _ in range(6)]
    m = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, quantization_config=NVFP4Config(method=method, calibration_data=data)
    )
    assert sum(isinstance(x, NVFP4Linear) for x in m.modules()) == 2 * 7
    attn = m.model.layers[1].self_attn
    assert attn.q_proj.weight_global_scale.item() == attn.k_proj.weight_global_scale.item()
    m.save_pretrained(tmp_path / "q")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["qerl"]["method"] == method
    assert qc["qerl"]["calibration_samples"] == 6 and "calibration_data" not in json.dumps(qc)
    m2 = nvfp4.load_nvfp4_checkpoint(tmp_path / "q", dtype=torch.float32)
    assert _state_equal(m, m2)
    ids = torch.randint(0, 256, (2, 7), generator=gen)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m2(ids).logits)


def test_llm_compressor_checkpoint_with_empty_ignore_loads_its_quantized_lm_head(tiny_model_dir, tmp_path):
    """A compressed-tensors config with ``"ignore": []`` (llm-compressor quantized every Linear, lm_head included)
    loads lm_head as NVFP4; it was kept dense, its weight missing, so it was initialised at random."""
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(modules_to_not_convert=[]))
    assert isinstance(m.lm_head, NVFP4Linear)
    m.save_pretrained(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == []
    del cfg["quantization_config"]["qerl"]  # as llm-compressor writes it
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    r = nvfp4.from_compressed_tensors(tmp_path / "q")
    assert isinstance(r.lm_head, NVFP4Linear)
    assert _state_equal(m, r)


def test_config_with_no_fused_groups_keeps_none():
    """``NVFP4Config(fused_groups=[])`` (every linear its own global scale, as ``quantize_model(fused_groups=[])``)
    was replaced by the default q/k/v and gate/up groups."""
    assert NVFP4Config(fused_groups=[]).fused_groups == []
    assert NVFP4Config(fused_groups=[]).to_dict()["qerl"]["fused_groups"] == []


def test_tied_lm_head_with_nothing_skipped_saves_a_config_that_reloads(tmp_path):
    """``modules_to_not_convert=[]`` on a model with tied embeddings: lm_head's weight is the embedding's, never
    quantized, yet the saved config said ``ignore: []``, so reloading it (ours, compressed-tensors) looked for
    ``lm_head.weight_packed`` and failed; the config now names the linears left dense."""
    from tiny_models import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=True)).to(torch.bfloat16).save_pretrained(
        tmp_path / "dense"
    )
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=NVFP4Config(modules_to_not_convert=[]))
    assert not isinstance(m.lm_head, NVFP4Linear)
    m.save_pretrained(tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    r = nvfp4.load_nvfp4_checkpoint(tmp_path / "q")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(r(ids).logits, m(ids).logits)


def test_saved_ignore_lists_every_dense_linear_as_compressed_tensors_reads_it(tiny_model_dir, tmp_path):
    """``modules_to_not_convert`` holds suffixes and regexes (``o_proj``), which compressed-tensors' ``ignore``
    matches only as exact names or ``re:`` regexes: the saved config made stock transformers / vLLM take every
    ``o_proj`` as NVFP4 (its dense weight dropped, the layer initialised at random). The ignore list now names them."""
    from compressed_tensors.utils.match import is_match

    cfg = NVFP4Config(modules_to_not_convert=["lm_head", "o_proj", r".*layers\.1\.mlp\.down_proj"])
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=cfg)
    assert cfg.modules_to_not_convert == ["lm_head", "o_proj", r".*layers\.1\.mlp\.down_proj"]  # the caller's, as given
    m.save_pretrained(tmp_path / "q")
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    dense = [n for n, x in m.named_modules() if type(x) is torch.nn.Linear]
    assert len(dense) == 4  # lm_head, 2 x o_proj, layers.1 down_proj
    for n, x in m.named_modules():
        if isinstance(x, torch.nn.Linear):
            assert is_match(n, x, ["Linear"], ignore) == isinstance(x, NVFP4Linear), (n, ignore)
    r = nvfp4.load_nvfp4_checkpoint(tmp_path / "q")
    assert _state_equal(m, r)


def test_llm_compressor_ignore_regex_matches_as_compressed_tensors_does(tiny_model_dir, tmp_path):
    """compressed-tensors applies an ``re:`` ignore entry with ``re.match`` (a prefix: ``re:model.layers.1`` skips
    every linear of layer 1); ours took it as a full match, so such a checkpoint failed to load (layer 1's 4-bit
    tensors were expected)."""
    cfg = NVFP4Config(modules_to_not_convert=["lm_head", r"model\.layers\.1\..*"])
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=cfg)
    m.save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    del config["quantization_config"]["qerl"]  # as llm-compressor writes it
    config["quantization_config"]["ignore"] = ["lm_head", r"re:model\.layers\.1"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    r = nvfp4.from_compressed_tensors(tmp_path / "q")
    assert type(r.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert _state_equal(m, r)


def test_compressed_tensors_re_entries_given_to_our_config_keep_those_linears_dense(tiny_model_dir, tmp_path):
    """``modules_to_not_convert=["re:..."]`` (llm-compressor's ``ignore`` syntax) matched no module (ours read it as a
    regex for the whole name, ``re:`` included), so those linears were quantized, and the saved ``ignore`` (the entry
    as given) made compressed-tensors readers take them as dense. Now an ``re:`` entry matches as compressed-tensors
    matches it (``re.match``)."""
    from compressed_tensors.utils.match import is_match

    cfg = NVFP4Config(modules_to_not_convert=["lm_head", r"re:.*mlp\.down_proj"])
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=cfg)
    assert type(m.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(m.model.layers[0].mlp.up_proj, NVFP4Linear)
    m.save_pretrained(tmp_path / "q")
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    for n, x in m.named_modules():
        if isinstance(x, torch.nn.Linear):
            assert is_match(n, x, ["Linear"], ignore) == isinstance(x, NVFP4Linear), (n, ignore)
    assert _state_equal(m, nvfp4.load_nvfp4_checkpoint(tmp_path / "q"))


@pytest.mark.parametrize("how", ["quantize_model", "quantize_model-mxfp4", "quantize_model-in-parts", "calibrate_model-gptq"])
def test_a_model_converted_in_memory_saves_a_checkpoint_that_reloads(tiny_model_dir, tmp_path, how):
    """README's torchao-style calls (``nvfp4.quantize_model(model)``, ``calibrate_model(model, "gptq", batches)``) on a
    model already held left its config without a ``quantization_config``: ``save_pretrained`` wrote the 4-bit tensors
    under a dense config, so a plain ``from_pretrained`` initialised every quantized linear at random (a warning
    table) and ``load_nvfp4_checkpoint`` said "not an NVFP4 checkpoint". The conversion now records its config."""
    from nvfp4.calibration import calibrate_model

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, 256, (2, 7))
    skip = ["lm_head", "o_proj"]
    if how.startswith("calibrate_model"):
        calibrate_model(m.eval(), "gptq", [ids], modules_to_not_convert=skip, progress=False)
    elif how.endswith("in-parts"):  # the recorded config follows the second call too
        nvfp4.quantize_model(m, modules_to_not_convert=skip, filter_fn=lambda n, _: "mlp" in n, progress=False)
        nvfp4.quantize_model(m, modules_to_not_convert=skip, progress=False)
    else:
        fmt = how.partition("-")[2] or "nvfp4"  # "quantize_model" or "quantize_model-mxfp4"
        nvfp4.quantize_model(m, modules_to_not_convert=skip, format=fmt, progress=False)
    m.save_pretrained(tmp_path / "q")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    r = nvfp4.load_nvfp4_checkpoint(tmp_path / "q")
    assert type(r.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert _state_equal(m, r)
    with torch.no_grad():
        assert torch.equal(r(ids).logits, m(ids).logits)


def test_load_nvfp4_checkpoint_says_why_a_compressed_tensors_checkpoint_does_not_load(tiny_model_dir, tmp_path):
    """llm-compressor's ``NVFP4`` scheme (W4A4: activations quantized too, the common NVFP4 checkpoint on the Hub) made
    ``load_nvfp4_checkpoint`` say "not an NVFP4 checkpoint" and print the whole config; it now says what disagrees,
    as ``from_compressed_tensors`` does."""
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config())
    m.save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group",
                                  "dynamic": "local"}  # fmt: skip
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(NVFP4CheckpointError, match=r"quantizes activations \(W4A4\)") as info:
        nvfp4.load_nvfp4_checkpoint(tmp_path / "q")
    assert "not an NVFP4 checkpoint" not in str(info.value) and len(str(info.value)) < 200


@pytest.mark.parametrize("format", ["nvfp4", "mxfp4"])
def test_model_dequantize_gives_the_dense_model_it_computes(tiny_model_dir, tmp_path, format):
    """transformers' ``model.dequantize()`` (the quantizer's ``_dequantize``) raised NotImplementedError ("please raise
    an issue on GitHub"); it now gives plain linears holding ``dequant(W)``: the same logits, a dense checkpoint."""
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(format=format))
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        ref = m(ids).logits
    d = m.dequantize()
    assert not any(isinstance(x, NVFP4Linear) for x in d.modules())
    assert getattr(d.config, "quantization_config", None) is None
    assert {p.dtype for p in d.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(d(ids).logits, ref)
    d.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "dense")(ids).logits, ref)


def test_quantize_model_leaves_a_tied_lm_head_dense_as_quantize_on_load_does(tmp_path):
    """``quantize_model(model, modules_to_not_convert=[])`` on a model with tied embeddings quantized lm_head (whose
    weight is the embedding's): the tie was cut, and the saved checkpoint failed to reload ("`weight` is not an
    nn.Parameter": transformers ties lm_head.weight to the embedding). A tied linear now stays dense, as quantize on
    load and the calibrated methods leave it."""
    from tiny_models import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=True)).to(torch.bfloat16).save_pretrained(
        tmp_path / "dense"
    )
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "dense")
    nvfp4.quantize_model(m, modules_to_not_convert=[], progress=False)
    assert type(m.lm_head) is torch.nn.Linear and m.lm_head.weight is m.model.embed_tokens.weight
    assert isinstance(m.model.layers[0].mlp.down_proj, NVFP4Linear)
    m.save_pretrained(tmp_path / "q")
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(nvfp4.load_nvfp4_checkpoint(tmp_path / "q")(ids).logits, m(ids).logits)


def test_save_pretrained_by_blocks_ignore_lists_every_dense_linear(tmp_path):
    """``save_pretrained_by_blocks`` wrote ``modules_to_not_convert``'s suffixes as compressed-tensors' ignore (exact
    names there), so stock readers took the dense ``o_proj`` as NVFP4."""
    from compressed_tensors.utils.match import is_match
    from tiny_models import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config())

    def fill(m):
        m.to_empty(device="cpu")
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)

    blocks = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head"]
    cfg = NVFP4Config(modules_to_not_convert=["lm_head", "o_proj"])
    nvfp4.save_pretrained_by_blocks(model, tmp_path / "q", blocks, fill, cfg)
    assert cfg.modules_to_not_convert == ["lm_head", "o_proj"]  # the caller's config is left as it was
    ignore = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]
    for n, x in model.named_modules():
        if isinstance(x, torch.nn.Linear):
            assert is_match(n, x, ["Linear"], ignore) == isinstance(x, NVFP4Linear), (n, ignore)


def test_calibrated_method_leaves_a_tied_lm_head_dense(tmp_path):
    """``method="awq"`` with ``modules_to_not_convert=[]`` on a model with tied embeddings quantized lm_head (the
    embedding's weight) and the load then failed in transformers' tying (``weight`` is not an nn.Parameter); a tied
    linear now stays dense, as RTN on load leaves it, and the checkpoint reloads."""
    from tiny_models import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=True)).to(torch.bfloat16).save_pretrained(
        tmp_path / "dense"
    )
    ids = torch.randint(0, 256, (1, 8))
    cfg = NVFP4Config(method="awq", modules_to_not_convert=[], calibration_data=[ids[0]])
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=cfg)
    assert not isinstance(m.lm_head, NVFP4Linear) and isinstance(m.model.layers[0].mlp.down_proj, NVFP4Linear)
    m.save_pretrained(tmp_path / "q")
    r = nvfp4.load_nvfp4_checkpoint(tmp_path / "q")
    assert torch.equal(r(ids).logits, m(ids).logits)


@pytest.mark.parametrize(
    "keyword, value", [("modules_to_not_convert", "lm_head"), ("fused_groups", ["q_proj", "k_proj"])]
)
def test_config_refuses_a_string_where_a_list_of_names_is_meant(keyword, value):
    """``NVFP4Config(modules_to_not_convert="lm_head")`` kept the letters ``l``, ``m``, ... dense and quantized
    lm_head; ``fused_groups=["q_proj", "k_proj"]`` fused nothing. Now one line naming the option."""
    with pytest.raises(TypeError, match=rf"NVFP4Config: {keyword} .*got the string '[a-z_]+'"):
        NVFP4Config(**{keyword: value})


def test_calibration_texts_instead_of_token_ids_are_refused_by_the_config():
    """``calibration_data=["some text", ...]`` (texts, not token ids) loaded the whole dense model and then failed in
    torch with "new(): invalid data type 'str'"; the config now says what it needs, before anything loads."""
    with pytest.raises(ValueError, match=r"calibration_data\[1\]: a string; expected token ids .*tokenizer"):
        NVFP4Config(method="awq", calibration_data=[[1, 2, 3], "What is 2 + 3?"])


def test_calibration_data_as_one_tokenizer_batch_is_one_batch(tiny_model_dir):
    """``calibration_data=tokenizer(texts, padding=True, return_tensors="pt")`` (a BatchEncoding) or its
    ``input_ids`` (an int tensor [B, T]), HF's usual calibration batch: the first was refused as "a string ... tokenize
    the texts first" (its keys were read as the samples), the second failed with "Boolean value of Tensor with more
    than one value is ambiguous". Either is now one batch, as ``[batch]`` is."""
    from transformers import BatchEncoding

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 9), generator=gen)
    batch = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    ref = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, quantization_config=NVFP4Config(method="awq", calibration_data=[ids])
    )
    for data in (ids, batch):
        cfg = NVFP4Config(method="awq", calibration_data=data)
        assert cfg.extra["calibration_samples"] == 1
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=cfg)
        assert _state_equal(m, ref)


def test_save_pretrained_by_blocks_shows_progress_over_the_blocks(tmp_path, capsys):
    """Saving a model too large to exist dense (a 32B: 64 decoder layers, each filled, quantized and written) showed
    nothing until it ended; a progress bar over the blocks now (``progress=False`` turns it off)."""
    from tiny_models import tiny_config

    def fill(m):
        m.to_empty(device="cpu")
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)

    blocks = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head"]
    for progress in (True, False):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config())
        nvfp4.save_pretrained_by_blocks(model, tmp_path / f"q{progress}", blocks, fill, progress=progress)
        err = capsys.readouterr().err
        assert ("6/6" in err and "block" in err) == progress, err


def test_a_model_without_a_linear_to_quantize_is_refused_on_load(tmp_path):
    """``from_pretrained(gpt2_like, quantization_config=NVFP4Config())``: GPT-2's projections are transformers
    ``Conv1D``, not ``nn.Linear``, and lm_head is kept dense, so nothing was quantized, without a word; the model
    loaded dense and saved under a 4-bit config. Now one line naming the model and what is quantized."""
    from transformers import GPT2Config

    AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=32,
                                                bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "g")  # fmt: skip
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no nn\.Linear .* to quantize") as info:
        AutoModelForCausalLM.from_pretrained(tmp_path / "g", quantization_config=NVFP4Config())
    assert len(str(info.value).splitlines()) == 1


def test_loading_a_checkpoint_with_a_config_of_ones_own(tiny_model_dir, tmp_path):
    """``load_nvfp4_checkpoint(path, config=cfg)`` / ``from_compressed_tensors(path, config=cfg)`` (transformers' way
    to load with another attention implementation or fewer layers) failed with "from_pretrained() got multiple values
    for keyword argument 'config'"; the given config is now the one loaded (with the checkpoint's quantization), and
    the caller's object is left as it was."""
    from transformers import AutoConfig

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config())
    m.save_pretrained(tmp_path / "q")
    cfg = AutoConfig.from_pretrained(tmp_path / "q")
    cfg.num_hidden_layers = 1
    before = cfg.to_dict()
    for load in (nvfp4.load_nvfp4_checkpoint, nvfp4.from_compressed_tensors):
        loaded = load(tmp_path / "q", config=cfg)
        assert len(loaded.model.layers) == 1 and isinstance(loaded.model.layers[0].mlp.up_proj, NVFP4Linear)
        assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight_packed, m.model.layers[0].mlp.up_proj.weight_packed)
    assert cfg.to_dict() == before


def test_config_refuses_an_unknown_option_and_still_loads_a_saved_one(tiny_model_dir, tmp_path):
    """``NVFP4Config(modules_to_not_covert=["model.layers.0"])`` (a typo) was taken as an unknown option: block 0 was
    quantized without a word and the typo written into the saved config. An option the config does not know is now one
    TypeError naming it and the options there are; a saved config whose fields this version does not know (a later
    version's) still loads and keeps them."""
    for make in (NVFP4Config, nvfp4.MXFP4Config):
        with pytest.raises(TypeError, match=r"unknown option 'modules_to_not_covert'.*modules_to_not_convert") as info:
            make(modules_to_not_covert=["model.layers.0"])
        assert len(str(info.value).splitlines()) == 1
    for serialization in ("compressed-tensors", QUANT_METHOD):
        saved = NVFP4Config(method="mse", serialization=serialization).to_dict()
        (saved["qerl"] if serialization == "compressed-tensors" else saved)["later_field"] = 3
        back = NVFP4Config.from_dict(saved)
        assert (back.method, back.extra) == ("mse", {"later_field": 3})
        if serialization == "compressed-tensors":
            assert back.to_dict() == saved
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config())
    m.save_pretrained(tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["qerl"]["later_field"] = 3
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    assert isinstance(nvfp4.from_compressed_tensors(tmp_path / "q").model.layers[0].mlp.up_proj, NVFP4Linear)


def test_loaders_name_a_missing_local_folder_and_point_elsewhere_for_other_checkpoints(tiny_model_dir, tmp_path):
    """``nvfp4.from_compressed_tensors("/models/typo")`` said "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'" (a missing folder read as a Hub id); a dense checkpoint or one with the previous
    ``nvfp4_w4a16`` config was refused without saying which call loads it. Each is now one line that says so."""
    missing = tmp_path / "no-such-checkpoint"
    for load in (nvfp4.from_compressed_tensors, nvfp4.load_nvfp4_checkpoint):
        with pytest.raises(FileNotFoundError, match=r"no-such-checkpoint: no such checkpoint folder") as info:
            load(missing)
        assert "Repo id" not in str(info.value) and len(str(info.value).splitlines()) == 1
        with pytest.raises(NVFP4CheckpointError, match=r"no quantization_config.*quantization_config=NVFP4Config\(\)"):
            load(tiny_model_dir)
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=NVFP4Config(serialization=QUANT_METHOD))
    m.save_pretrained(tmp_path / "old")
    with pytest.raises(NVFP4CheckpointError, match=r"previous nvfp4_w4a16 config.*nvfp4.load_nvfp4_checkpoint") as info:
        nvfp4.from_compressed_tensors(tmp_path / "old")
    assert len(str(info.value).splitlines()) == 1
