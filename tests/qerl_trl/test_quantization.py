"""``quantization`` = ``<format>-<method>`` (issues #22, #38): the scheme registry (one parser, aliases, each scheme's
config, load, conversion and layers), the NF4 (bitsandbytes, QLoRA) and MXFP4 policies in the trainer and ``qerl eval``,
and AQN on every scheme (noise on, then restored bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from aqn import AQNController, make_schedule
from qerl_trl.config import QeRLConfig
from qerl_trl.policy import load_policy
from qerl_trl.quantization import ALIASES, SCHEMES, QuantScheme, get_scheme
from qerl_trl.tasks import load_task

#: every scheme that loads from the weights alone (the calibrated ones need prompts: tested below)
LOADABLE = [s for s in SCHEMES.values() if not s.calibrated]


def test_parse_canonical_values_and_aliases():
    assert tuple(SCHEMES) == ("nvfp4-rtn", "nvfp4-mse", "nvfp4-awq", "nvfp4-gptq", "mxfp4-rtn", "nf4", "none")
    q = get_scheme("nvfp4-gptq")
    assert (q.name, q.format.name, q.method, q.calibrated, q.cache_tag) == ("nvfp4-gptq", "nvfp4", "gptq", True, "gptq")
    assert get_scheme(q) is q and str(q) == "nvfp4-gptq"
    for alias, canonical in ALIASES.items():
        assert get_scheme(alias) is SCHEMES[canonical]
        assert get_scheme(alias.upper()) is SCHEMES[canonical]
    nf4, mx, dense = (get_scheme(v) for v in ("nf4", "mxfp4-rtn", "none"))
    assert (nf4.format, nf4.method, nf4.calibrated, nf4.cache_tag) == (None, None, False, "nf4")
    assert (mx.format.name, mx.method, mx.cache_tag) == ("mxfp4", "rtn", "mxfp4-rtn")
    assert dense.is_dense and dense.format is None
    assert [s.name for s in SCHEMES.values() if s.vllm_engine] == [*(f"nvfp4-{m}" for m in ALIASES), "none"]
    for bad in ("int4", "mxfp4-gptq", "nf4-rtn", "nvfp4", ""):
        with pytest.raises(ValueError, match="quantization must be one of") as info:
            get_scheme(bad)
        assert all(repr(v) in str(info.value) for v in SCHEMES) and "'rtn' (= 'nvfp4-rtn')" in str(info.value)


@pytest.mark.parametrize("scheme", SCHEMES.values(), ids=str)
def test_each_scheme_knows_its_config(scheme: QuantScheme):
    """The transformers config each scheme quantizes with on load: ``NVFP4Config`` in the scheme's format and method,
    bitsandbytes' QLoRA config, or none; calibrated schemes refuse to build one without prompts."""
    from nvfp4 import NVFP4Config
    from transformers import BitsAndBytesConfig

    data = [torch.tensor([1, 2, 3])] if scheme.calibrated else None
    cfg = scheme.hf_config(torch.float32, calibration_data=data)
    if scheme.format is not None:
        assert isinstance(cfg, NVFP4Config) and cfg.weight_format is scheme.format and cfg.method == scheme.method
    elif scheme.is_dense:
        assert cfg is None
    else:
        assert (
            isinstance(cfg, BitsAndBytesConfig) and cfg.bnb_4bit_quant_type == "nf4" and cfg.bnb_4bit_use_double_quant
        )
    if scheme.calibrated:
        with pytest.raises(ValueError, match="needs calibration_data"):
            scheme.hf_config(torch.float32)


@pytest.mark.parametrize("scheme", LOADABLE, ids=str)
def test_each_scheme_loads_and_converts_to_its_layers(tiny_dir, scheme: QuantScheme):
    """``load`` (quantize while loading) gives ``layer_type`` for all 14 linears; ``quantize_`` of the dense model
    gives the same layers with the same tensors (``lm_head`` dense in both)."""
    model = load_policy(str(tiny_dir), quantization=scheme)
    layers = [m for n, m in model.named_modules() if n.endswith("_proj")]
    assert len(layers) == 14 and all(type(m) is scheme.layer_type for m in layers)
    converted = scheme.quantize_(load_policy(str(tiny_dir), quantization="none"))
    assert [type(m) for m in converted.modules()] == [type(m) for m in model.modules()]
    ours, theirs = model.state_dict(), converted.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_calibrated_scheme_converts_a_held_model(tiny_dir):
    """``quantize_`` with calibration batches (torchao style) on a calibrated scheme: every linear is NVFP4."""
    from nvfp4 import NVFP4Linear

    scheme = get_scheme("nvfp4-awq")
    with pytest.raises(ValueError, match="needs calibration_data"):
        scheme.quantize_(load_policy(str(tiny_dir), quantization="none"))
    model = scheme.quantize_(
        load_policy(str(tiny_dir), quantization="none"), calibration_data=[torch.tensor([[1, 2, 3]])]
    )
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) == 14


def test_calibration_prompts_come_from_an_iterable_data_set_too(tiny_dir):
    """quantization='nvfp4-awq' / 'nvfp4-gptq' with a streamed (IterableDataset) train_dataset, which TRL trains on:
    calibration_prompt_ids took len(dataset) and failed with "object of type 'IterableDataset' has no len()". The
    first n prompts are read by iterating, the same ids as from the map-style data set."""
    from qerl_trl.policy import calibration_prompt_ids, load_tokenizer

    tok = load_tokenizer(tiny_dir)
    rows = load_task("arithmetic", n_examples=6)
    streamed = rows.to_iterable_dataset()
    for n in (4, 10):
        got, want = calibration_prompt_ids(streamed, tok, n), calibration_prompt_ids(rows, tok, n)
        assert len(got) == min(n, 6) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_optional_backends_load_only_for_their_scheme():
    """``qerl train --quantization foo`` stops with one line before TRL (hence PEFT, hence bitsandbytes) is imported;
    bitsandbytes' import logs a warning on AVX512-BF16 CPUs (kernels-community), which must not precede our error.
    The name is checked against the option snapshot (torch not imported either), with the parser's own message."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from qerl_trl.cli import parse_train_args\n"
        "try:\n    parse_train_args(['--quantization', 'foo'])\nexcept ValueError as e:\n    print(e)\n"
        "print(sorted(m for m in ('bitsandbytes', 'peft', 'trl', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    with pytest.raises(ValueError) as parsed:
        get_scheme("foo")
    assert out.splitlines() == [str(parsed.value), "[]"], out


def test_config_stores_the_canonical_name_and_refuses_vllm_for_other_formats(tmp_path):
    assert QeRLConfig(output_dir=str(tmp_path)).quantization == "nvfp4-rtn"
    config = QeRLConfig(output_dir=str(tmp_path), quantization="gptq")
    assert config.quantization == "nvfp4-gptq" and config.quant_scheme is SCHEMES["nvfp4-gptq"]
    assert QeRLConfig(output_dir=str(tmp_path), quantization="nf4").quantization == "nf4"
    with pytest.raises(ValueError, match="'mxfp4-rtn'.*got 'fp8'"):
        QeRLConfig(output_dir=str(tmp_path), quantization="fp8")
    for fmt in ("nf4", "mxfp4-rtn"):
        with pytest.raises(ValueError, match="rollout_engine='vllm'.*not supported"):
            QeRLConfig(output_dir=str(tmp_path), quantization=fmt, rollout_engine="vllm")


def test_old_recipe_with_a_bare_method_still_parses(tmp_path):
    """A recipe (or a run's saved config) written before formats existed says ``quantization: rtn``."""
    from qerl_trl.cli import RECIPES_DIR, parse_train_args

    old = (RECIPES_DIR / "offline-default.yaml").read_text().replace("quantization: nvfp4-rtn", "quantization: rtn")
    assert "quantization: rtn" in old
    (tmp_path / "old.yaml").write_text(old)
    _, config = parse_train_args([str(tmp_path / "old.yaml")])
    assert config.quantization == "nvfp4-rtn"
    _, config = parse_train_args(["offline-default", "--quantization", "mse"])
    assert config.quantization == "nvfp4-mse"


def test_bnb_missing_names_the_extra(monkeypatch, tiny_dir, tmp_path, capsys):
    """Without bitsandbytes, ``quantization="nf4"`` names the extra; ``qerl train`` says it in one line, exit 2."""
    import sys

    import qerl_trl.trainer  # noqa: F401  (TRL imports bitsandbytes whenever it is installed: before hiding it)
    from nvfp4 import MissingExtraError
    from qerl_trl.cli import DEBUG_ENV, main

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'qerl-trl\[nf4\]'"):
        SCHEMES["nf4"].hf_config(torch.float32)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model_name_or_path", str(tiny_dir), "--quantization", "nf4", "--output_dir",
              str(tmp_path / "run"), "--report_to", "none"])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "qerl train: error: quantization='nf4' needs bitsandbytes: pip install 'qerl-trl[nf4]'", err


def _aqn_noise_applied_and_restored(model: torch.nn.Module) -> None:
    """AQN noise reaches every input/post-attention RMSNorm weight during a rollout and is undone bit for bit; the
    4-bit weights are not touched."""
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("layernorm.weight")}
    frozen = {n: t.detach().clone() for n, t in model.state_dict().items() if "proj" in n}
    assert norms and frozen
    ctl = AQNController(make_schedule("constant", 1e-2, 1e-2, 2, total_steps=4), seed=0)
    with ctl.rollout(model, 3) as handle:
        assert handle is not None
        live = dict(model.named_parameters())
        for name, clean in norms.items():
            assert not torch.equal(live[name].detach(), clean), f"{name}: no noise"
            rel = (live[name].detach().float() - clean.float()).norm() / clean.float().norm()
            assert 0 < rel < 0.1, (name, rel)
        model(torch.tensor([[1, 2, 3, 4]]))  # the noisy model runs
    live = dict(model.named_parameters())
    for name, clean in norms.items():
        assert torch.equal(live[name].detach(), clean), f"{name}: not restored exactly"
    after = model.state_dict()
    for name, t in frozen.items():
        assert torch.equal(after[name], t), f"{name} changed"


@pytest.mark.parametrize("scheme", LOADABLE, ids=str)
def test_aqn_noise_applied_and_restored_on_every_scheme(tiny_dir, scheme: QuantScheme):
    model = load_policy(str(tiny_dir), quantization=scheme)
    if scheme.name == "nf4":  # bitsandbytes' own state: NF4 with double quantization, as QLoRA
        linears = [m for m in model.modules() if isinstance(m, scheme.layer_type)]
        assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested for m in linears)
    _aqn_noise_applied_and_restored(model)


@pytest.mark.parametrize("quantization", ["nf4", "mxfp4-rtn"])
def test_trainer_builds_a_lora_policy_and_takes_a_grpo_step(tmp_path, tiny_dir, quantization):
    """``qerl train``'s model builder from a model path: NF4 (bitsandbytes, QLoRA) / MXFP4 base, PEFT LoRA the only
    trainable parameters, one real GRPO step with AQN noise on CPU; the 4-bit base is unchanged by it."""
    from qerl_trl.trainer import QeRLGRPOTrainer

    args = QeRLConfig(output_dir=str(tmp_path / "run"), quantization=quantization, max_steps=1,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=4, logging_steps=1,
                      save_strategy="no", report_to=[], learning_rate=1e-2, aqn_num_stages=2, aqn_sigma_start=1e-2,
                      aqn_sigma_end=1e-2, aqn_schedule="constant", seed=0, disable_tqdm=True)  # fmt: skip

    def reward(completions, completion_ids, **kwargs):
        return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]

    trainer = QeRLGRPOTrainer(str(tiny_dir), reward, args, train_dataset=load_task("arithmetic", n_examples=8))
    model = trainer.model
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())  # fp32 adapters for every format (not TRL's bf16)
    bases = [m.get_base_layer() for m in model.modules() if hasattr(m, "lora_A")]
    assert len(bases) == 14 and all(type(b) is args.quant_scheme.layer_type for b in bases)
    frozen = {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n}
    assert any(t.dtype == torch.uint8 for t in frozen.values())
    trainer.train()
    assert trainer.state.global_step == 1
    (log,) = [h for h in trainer.state.log_history if "reward" in h]
    assert log["aqn/sigma"] == pytest.approx(1e-2) and log["entropy"] == log["entropy"]
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, trainable[n])]
    assert moved, "no LoRA weight moved"
    after = model.state_dict()
    changed = [n for n, t in frozen.items() if not torch.equal(after[n], t)]
    assert not changed, f"frozen base changed: {changed[:3]}"
    # qerl eval of the trained adapter on the same format (loaded and verified tensor by tensor)
    from qerl_trl.evaluation import load_model

    trainer.save_model(str(tmp_path / "final"))
    _, _, info = load_model(str(tiny_dir), quantization=quantization, adapter=str(tmp_path / "final"))
    assert info["adapter"]["lora_layers"] == 14 and not info["adapter"]["all_b_zero"]


def test_eval_accepts_the_same_names(tiny_dir, tmp_path, capsys):
    import bitsandbytes as bnb
    from qerl_trl.evaluation import build_parser, load_model, main

    parser = build_parser()
    assert parser.parse_args(["--quantization", "gptq"]).quantization is SCHEMES["nvfp4-gptq"]
    assert parser.parse_args([]).quantization is SCHEMES["none"]
    capsys.readouterr()
    assert parser.parse_args(["--quantize", "nf4"]).quantization is SCHEMES["nf4"]  # the deprecated name
    assert "--quantize is deprecated, use --quantization" in capsys.readouterr().err
    with pytest.raises(ValueError, match="argument --quantization/--quantize: --quantization must be one of"):  # UsageError
        parser.parse_args(["--quantization", "int4"])
    model, _, info = load_model(str(tiny_dir), quantization="nf4")
    assert info["quantize"] == "nf4"
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 14
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(tiny_dir), quantization="int8")
    with pytest.raises(ValueError, match="--engine vllm loads NVFP4 or dense checkpoints, not --quantization nf4"):
        main(["--model", str(tiny_dir), "--quantization", "nf4", "--engine", "vllm", "--task", "arithmetic"])
    model, _, info = load_model(str(tiny_dir), quantization="mxfp4-rtn")
    assert info["quantize"] == "mxfp4-rtn"
    assert sum(m.format == "mxfp4" for m in model.modules() if isinstance(m, SCHEMES["mxfp4-rtn"].layer_type)) == 14


def test_calibrated_policy_is_saved_once_per_machine(tmp_path, tiny_dir, monkeypatch):
    """Every rank calibrates the same policy; only local rank 0 writes it (a 72B copy per rank would fill the disk),
    through a temporary folder of its own (``nvfp4.offline.publish_checkpoint``), and a checkpoint that another process
    published first is kept as it is."""
    from nvfp4.offline import publish_checkpoint

    scheme = get_scheme("nvfp4-gptq")
    ids = [[1, 2, 3, 4, 5, 6, 7, 8]] * 2
    monkeypatch.setenv("LOCAL_RANK", "1")
    scheme.load(str(tiny_dir), dtype=torch.float32, calibration_data=ids, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    monkeypatch.setenv("LOCAL_RANK", "0")
    scheme.load(str(tiny_dir), dtype=torch.float32, calibration_data=ids, cache_dir=tmp_path / "cache")
    (saved,) = (tmp_path / "cache").iterdir()
    assert (saved / "config.json").is_file() and ".partial" not in saved.name

    def write_stub(folder):
        folder.mkdir()
        (folder / "config.json").write_text("{}")

    assert publish_checkpoint(saved, write_stub) is False  # published first: the late copy is dropped
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [saved.name]
    assert (saved / "config.json").read_text() != "{}"  # the first one kept
    fresh = tmp_path / "fresh"
    assert publish_checkpoint(fresh, write_stub) is True and (fresh / "config.json").read_text() == "{}"


def test_the_vllm_engine_checkpoint_of_a_calibrated_policy_follows_its_calibration(tmp_path, tiny_dir):
    """The colocated vLLM engine loads the policy saved once per (model, method, ...): two GPTQ calibrations of one
    model on different prompts (another task, another calibration_samples) are two policies, so two engine
    checkpoints; the second run must not load the first run's weights into the engine."""
    from nvfp4 import NVFP4Linear
    from qerl_trl.rollout.vllm import engine_checkpoint

    scheme = get_scheme("nvfp4-gptq")
    paths, packed = [], []
    for ids in ([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, [[40, 41, 42, 43, 44, 45, 46, 47]] * 2):
        model = scheme.load(str(tiny_dir), dtype=torch.float32, calibration_data=ids, cache_dir=tmp_path / "calibrated")
        packed.append(torch.cat([m.quantized_weight.packed.flatten() for m in model.modules()
                                 if isinstance(m, NVFP4Linear)]))  # fmt: skip
        paths.append(engine_checkpoint(str(tiny_dir), model, scheme, cache_dir=str(tmp_path / "engine")))
    assert not torch.equal(packed[0], packed[1])  # the two calibrations quantized differently
    assert paths[0] != paths[1]


def test_the_vllm_engine_checkpoint_of_a_policy_carrying_an_adapter_is_its_base(tmp_path, tiny_dir):
    """``qerl eval --engine vllm --quantization nvfp4-rtn --adapter A`` saves the evaluated model's base (the adapter
    goes to the engine as a LoRA adapter): the checkpoint holds the base's names and tensors, never PEFT's
    ``base_layer`` names or the adapter's ``lora_A`` / ``lora_B``, and the model keeps its LoRA layers."""
    from nvfp4.peft import get_peft_model
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer
    from qerl_trl.rollout.vllm import engine_checkpoint
    from safetensors import safe_open

    scheme = get_scheme("nvfp4-rtn")
    model = get_peft_model(scheme.load(str(tiny_dir), dtype=torch.float32), LoraConfig(r=8, target_modules=["q_proj"]))
    path = engine_checkpoint(str(tiny_dir), model.get_base_model(), scheme, cache_dir=str(tmp_path / "engine"))
    keys = {k for f in sorted(Path(path).glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}
    assert "model.layers.0.self_attn.q_proj.weight_packed" in keys
    assert not [k for k in keys if "lora_" in k or "base_layer" in k], sorted(keys)
    assert sum(isinstance(m, LoraLayer) for m in model.modules()) == 2  # the adapter is still in the model
