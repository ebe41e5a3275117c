"""``qerl eval`` (qerl_trl.evaluation) end to end on a tiny random Llama with the offline default model's tokenizer."""

from __future__ import annotations

import json
import math
from itertools import combinations

import pytest
import torch
from qerl_trl.evaluation import AdapterNotLoadedError, evaluate, load_model, main, pass_at_k, verify_adapter
from qerl_trl.tasks import load_task
from qerl_trl.validation import UsageError

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_adapter(base_dir, out_dir, seed: int, scale: float = 1.0):
    """A LoRA adapter with large random A and B (B is zero at PEFT's default init, which would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir, tmp_path_factory):
    return _make_adapter(tiny_dir, tmp_path_factory.mktemp("adapter") / "lora", seed=1)


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    main(["--task", "arithmetic", "--limit", "3", "--max-new-tokens", "6", "--output", str(out), "--no-progress",
          *extra])
    return json.loads((out / "eval.json").read_text()), (out / "eval.md").read_text()


def test_pass_at_k_matches_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert math.isclose(pass_at_k(n, c, k), expected), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_cli_end_to_end_writes_json_and_markdown(tiny_dir, tmp_path, capsys):
    result, md = _run(tmp_path, "base", "--model", str(tiny_dir), "--n-samples", "2", "--temperature", "1.0",
                      "--batch-size", "2")
    m, s = result["metrics"], result["settings"]
    assert m["n_examples"] == 3 and m["n_samples"] == 2
    assert {"pass@1", "pass@2", "mean_reward", "mean_completion_tokens", "truncated_fraction"} <= set(m)
    assert 0.0 <= m["pass@1"] <= m["pass@2"] <= 1.0
    assert s["task"] == "arithmetic" and s["split"] == "test" and s["adapter"] is None and s["quantize"] == "none"
    assert s["temperature"] == 1.0 and s["top_p"] == 0.95 and s["reward"] == "arithmetic_accuracy_reward"
    gold = list(load_task("arithmetic", "test", limit=3)["answer"])
    assert [r["answer"] for r in result["records"]] == gold
    for rec in result["records"]:
        assert len(rec["completions"]) == len(rec["rewards"]) == len(rec["correct"]) == 2
        assert all(1 <= t <= 6 for t in rec["completion_tokens"])
        assert rec["n_correct"] == sum(rec["correct"])
    assert "| model | adapter | quantize |" in md and "pass@2" in md and "tiny-llama" in md
    assert "pass@1" in capsys.readouterr().out


def test_evaluate_api_greedy_and_scoring(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ds = load_task("arithmetic", "test", limit=4)
    first = evaluate(model, tok, ds, reward_fn="arithmetic_accuracy", greedy=True, max_new_tokens=5, batch_size=3,
                     progress=False)
    completions = [r["completions"][0] for r in first["records"]]
    # a reward that accepts exactly these completions: greedy decoding reproduces them, batched differently
    accept = lambda completions, question, **kw: [float(c == completions_by_q[q]) for c, q in zip(completions, question)]
    completions_by_q = {r["question"]: r["completions"][0] for r in first["records"]}
    again = evaluate(model, tok, ds, reward_fn=accept, greedy=True, max_new_tokens=5, batch_size=4, progress=False)
    assert [r["completions"][0] for r in again["records"]] == completions
    assert again["metrics"]["pass@1"] == 1.0
    assert tok.padding_side == "right"  # evaluate pads left and puts the tokenizer back
    with pytest.warns(UserWarning, match="n_samples=3 -> 1"):
        evaluate(model, tok, ds.select([0]), reward_fn=accept, greedy=True, n_samples=3, max_new_tokens=2,
                 progress=False)


def test_evaluate_puts_back_a_tokenizer_without_a_pad_token(tiny_dir):
    """A tokenizer without a pad token: ``evaluate`` pads with EOS while it generates, and afterwards the caller's
    tokenizer has no pad token again (it kept EOS as its pad token), as its padding side is put back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.pad_token = None
    ds = load_task("arithmetic", "test", limit=2)
    result = evaluate(model, tok, ds, reward_fn="arithmetic_accuracy", greedy=True, max_new_tokens=2, batch_size=2,
                      progress=False)  # fmt: skip
    assert result["metrics"]["n_examples"] == 2
    assert tok.pad_token is None and tok.pad_token_id is None and tok.padding_side == "right"


def test_adapter_that_changes_outputs_changes_records_and_score(tiny_dir, adapter_dir, tmp_path):
    """The reference implementation evaluated the base model while claiming the adapter: here the adapter must show."""
    base, _ = _run(tmp_path, "base", "--model", str(tiny_dir), "--greedy")
    tuned, md = _run(tmp_path, "tuned", "--model", str(tiny_dir), "--greedy", "--adapter", str(adapter_dir))
    base_c = [r["completions"][0] for r in base["records"]]
    tuned_c = [r["completions"][0] for r in tuned["records"]]
    assert base_c != tuned_c
    info = tuned["settings"]["adapter"]
    assert info["path"] == str(adapter_dir) and info["lora_layers"] == 2 * len(LORA_TARGETS) and len(info["sha256"]) == 64
    assert "| lora |" in md

    # score: with a reward that accepts the base model's completions, the base scores 1.0 and the adapter less
    accept = lambda completions, question, **kw: [float(c == by_q[q]) for c, q in zip(completions, question)]
    by_q = {r["question"]: r["completions"][0] for r in base["records"]}
    ds = load_task("arithmetic", "test", limit=3)
    scores = {}
    for name, adapter in (("base", None), ("adapter", str(adapter_dir))):
        model, tok, _ = load_model(str(tiny_dir), adapter=adapter)
        res = evaluate(model, tok, ds, reward_fn=accept, greedy=True, max_new_tokens=6, progress=False)
        scores[name] = res["metrics"]["pass@1"]
    assert scores["base"] == 1.0 and scores["adapter"] < 1.0


def test_adapter_on_nvfp4_quantized_base(tiny_dir, adapter_dir, tmp_path):
    from nvfp4 import NVFP4Linear

    res, md = _run(tmp_path, "q", "--model", str(tiny_dir), "--greedy", "--quantization", "rtn", "--adapter",
                   str(adapter_dir))
    # the bare "rtn" of earlier versions is an alias: recorded by its canonical name
    assert res["settings"]["quantize"] == "nvfp4-rtn" and res["settings"]["adapter"]["lora_layers"] == 14
    model, _, _ = load_model(str(tiny_dir), quantization="nvfp4-rtn", adapter=str(adapter_dir))
    bases = [m.get_base_layer() for m in model.modules() if hasattr(m, "lora_A")]
    assert bases and all(isinstance(b, NVFP4Linear) for b in bases)
    assert "| nvfp4-rtn |" in md


def test_verify_adapter_catches_missing_wrong_or_disabled_adapters(tiny_dir, adapter_dir, tmp_path):
    model, _, _ = load_model(str(tiny_dir))
    with pytest.raises(AdapterNotLoadedError, match="not a PeftModel"):
        verify_adapter(model, adapter_dir)
    other = _make_adapter(tiny_dir, tmp_path / "other", seed=2)
    peft_model, _, info = load_model(str(tiny_dir), adapter=str(adapter_dir))
    assert info["adapter"]["tensors"] == 4 * len(LORA_TARGETS)
    with pytest.raises(AdapterNotLoadedError, match="differ from the model's"):
        verify_adapter(peft_model, other)
    with peft_model.disable_adapter(), pytest.raises(AdapterNotLoadedError, match="not active"):
        verify_adapter(peft_model, adapter_dir)
    verify_adapter(peft_model, adapter_dir)  # enabled again


def test_verify_adapter_names_a_diverged_adapter(tiny_dir, adapter_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    peft_model, _, _ = load_model(str(tiny_dir), adapter=str(adapter_dir))
    diverged = tmp_path / "diverged"
    shutil.copytree(adapter_dir, diverged)
    weights = load_file(str(diverged / "adapter_model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(diverged / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=rf"1 of {len(weights)} tensors hold NaN or inf, e.g. \['{name}'\]; the run"):
        verify_adapter(peft_model, diverged)


def test_untrained_adapter_warns(tiny_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "zero")
    with pytest.warns(UserWarning, match="B matrix is zero"):
        load_model(str(tiny_dir), adapter=str(tmp_path / "zero"))


def test_cli_errors(tiny_dir, tmp_path):
    from nvfp4 import NVFP4Config
    from transformers import AutoModelForCausalLM

    q = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=NVFP4Config(method="rtn"))
    q.save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match="already quantized"):
        load_model(str(tmp_path / "q"), quantization="rtn", tokenizer_path=str(tiny_dir))
    with pytest.raises(UsageError, match="argument --task: invalid choice: 'nope'"):
        main(["--task", "nope"])
    with pytest.raises(UsageError, match="--data-path .*missing': no such file or folder"):
        main(["--model", str(tiny_dir), "--task", "gsm8k", "--data-path", str(tmp_path / "missing")])
    (tmp_path / "data").mkdir()
    with pytest.raises(UsageError, match=r"--data-path .*data': the folder has no test.jsonl \(found: no .jsonl files\)"):
        main(["--model", str(tiny_dir), "--task", "gsm8k", "--data-path", str(tmp_path / "data")])
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        verify_adapter(__import__("peft").get_peft_model(q, __import__("peft").LoraConfig(target_modules=["q_proj"])),
                       tmp_path)


def test_a_model_without_a_chat_template_is_refused_before_it_loads(tiny_dir, base_dir, tmp_path, monkeypatch):
    """The tasks' prompts are chat messages: ``qerl eval`` of a model whose tokenizer has no chat template (a base
    model) loaded it and stopped in transformers' "Cannot use chat template functions" traceback; now a UsageError
    (one line) naming the model, or ``--tokenizer`` when that gives the tokenizer, before anything loads."""
    import qerl_trl.evaluation

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    base = base_dir
    monkeypatch.setattr(qerl_trl.evaluation, "load_model", no_model)
    with pytest.raises(UsageError, match=rf"^--model '{base}': .*no chat template"):
        main(["--model", str(base), "--task", "arithmetic", "--limit", "2", "--output", str(tmp_path / "out")])
    with pytest.raises(UsageError, match=rf"^--tokenizer '{base}': .*no chat template"):
        main(["--model", str(tiny_dir), "--tokenizer", str(base), "--task", "arithmetic", "--limit", "2",
              "--output", str(tmp_path / "out")])  # fmt: skip


def test_cli_gsm8k_from_local_jsonl(tiny_dir, gsm8k_dir, tmp_path):
    out = tmp_path / "gsm8k"
    main(["--model", str(tiny_dir), "--task", "gsm8k", "--data-path", str(gsm8k_dir), "--limit", "2",
          "--max-new-tokens", "3", "--greedy", "--output", str(out), "--no-progress"])
    result = json.loads((out / "eval.json").read_text())
    assert [r["answer"] for r in result["records"]] == ["18", "3"]
    assert result["settings"]["reward"] == "gsm8k_accuracy_reward" and result["settings"]["split"] == "test"
    assert result["records"][0]["question"].startswith("Janet")


def test_eval_calibrates_on_the_prompts_qerl_train_calibrates_on(tiny_dir):
    """An adapter trained on an AWQ / GPTQ base is evaluated on that base: ``qerl eval --quantization nvfp4-awq``
    calibrates on the token ids ``qerl train`` calibrated on (the first 32 training prompts as the rollouts see them:
    chat template with the generation prompt, no answer, no special tokens added), not on prompt + answer texts."""
    from qerl_trl.evaluation import calibration_data
    from qerl_trl.policy import calibration_prompt_ids
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    options = {"n_examples": 40}
    trained_on = calibration_prompt_ids(load_task("arithmetic", "train", seed=3, **options), tok, 32)
    evaluated = load_task("arithmetic", "test", limit=3, seed=3, **options)
    got = calibration_data("arithmetic", tok, evaluated, seed=3, options=options)
    assert len(got) == len(trained_on) == 32
    assert all(torch.equal(a, b) for a, b in zip(got, trained_on, strict=True))


def test_paths_written_with_a_tilde_are_the_home_folder(tiny_dir, adapter_dir, gsm8k_dir, tmp_path, monkeypatch):
    """``qerl eval --model '~/m' --output '~/out'`` (quoted, or ``--output=~/out``, which the shell leaves alone): the
    checks expanded ``~`` and passed, then the model load failed in transformers' 'Repo id must use alphanumeric
    chars' traceback, and --output wrote a folder named '~' in the working directory. Every path is the home's."""
    import shutil

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    for name, src in (("tiny", tiny_dir), ("lora", adapter_dir), ("gsm8k", gsm8k_dir)):
        shutil.copytree(src, home / name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    main(["--model", "~/tiny", "--tokenizer", "~/tiny", "--adapter", "~/lora", "--task", "gsm8k", "--data-path",
          "~/gsm8k", "--limit", "1", "--max-new-tokens", "2", "--greedy", "--output", "~/out", "--no-progress"])
    result = json.loads((home / "out" / "eval.json").read_text())
    assert result["settings"]["model"] == str(home / "tiny") and result["settings"]["adapter"]["lora_layers"] == 14
    assert not (cwd / "~").exists()


@pytest.mark.parametrize("device", [pytest.param("gpu", id="not-a-device-name"), "cuda:x", "meta", *([] if torch.cuda.is_available() else ["cuda"])])
def test_a_device_that_is_not_here_is_one_line_before_the_model_loads(device, tiny_dir, tmp_path, monkeypatch):
    """``--device gpu`` (not a device name) ended in transformers' multi-line device_map ValueError, ``--device cuda``
    on a machine without CUDA in torch's 'Found no NVIDIA driver' traceback, both after the data loaded; now a
    UsageError naming the value and what is accepted, before anything loads."""
    import qerl_trl.evaluation

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(qerl_trl.evaluation, "load_model", no_model)
    with pytest.raises(UsageError, match=rf"^--device '{device}': (not a device name|no .* device on this machine)"
                       r".*\bcpu\b") as info:
        main(["--model", str(tiny_dir), "--task", "arithmetic", "--limit", "1", "--device", device,
              "--output", str(tmp_path / "out")])  # fmt: skip
    assert "\n" not in str(info.value)


def test_quantizing_an_already_quantized_checkpoint_is_one_line(tiny_dir, tmp_path):
    """``qerl eval --model <an nvfp4-quantize checkpoint> --quantization nvfp4-mse`` ended in a ValueError traceback
    (qerl eval prints UsageErrors as one line, exit 2); now a UsageError naming the model and the option to drop."""
    import shutil

    from nvfp4 import NVFP4Config
    from transformers import AutoModelForCausalLM

    q = AutoModelForCausalLM.from_pretrained(tiny_dir, quantization_config=NVFP4Config(method="rtn"))
    q.save_pretrained(tmp_path / "q")
    for f in tiny_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, tmp_path / "q")
    with pytest.raises(UsageError, match=r"^--model '.*q' is already quantized .*drop --quantization nvfp4-mse"):
        main(["--model", str(tmp_path / "q"), "--quantization", "nvfp4-mse", "--task", "arithmetic", "--limit", "1",
              "--output", str(tmp_path / "out")])  # fmt: skip


@pytest.mark.parametrize("seed", [2**32, 10**20])
def test_a_seed_out_of_range_is_one_line(seed, tiny_dir, tmp_path):
    """``--seed 100000000000000000000`` passed the check (>= 0 only) and ended in torch.manual_seed's 'Overflow when
    unpacking long long' traceback; qerl train takes seeds in [0, 2**32), and so does qerl eval now."""
    with pytest.raises(UsageError, match=rf"^--seed must be in \[0, 2\*\*32\), got {seed}$"):
        main(["--model", str(tiny_dir), "--task", "arithmetic", "--limit", "1", "--seed", str(seed),
              "--output", str(tmp_path / "out")])  # fmt: skip


def test_a_model_or_adapter_given_as_dot_is_named_in_the_output(tiny_dir, adapter_dir, tmp_path, monkeypatch):
    """``qerl eval --model .`` (run inside the model's folder) wrote runs/eval/-arithmetic-test, an empty model
    column in eval.md and "model": "." in eval.json (which names nothing once read elsewhere); ``--adapter .``
    likewise. A local folder is recorded and named by its absolute path."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(tiny_dir, work / "tiny-llama")
    shutil.copytree(adapter_dir, work / "lora")
    args = ["--task", "arithmetic", "--limit", "1", "--max-new-tokens", "2", "--greedy", "--no-progress"]
    monkeypatch.chdir(work / "tiny-llama")
    main(["--model", ".", *args])
    out = work / "tiny-llama" / "runs" / "eval" / "tiny-llama-arithmetic-test"
    result = json.loads((out / "eval.json").read_text())
    assert result["settings"]["model"] == str(work / "tiny-llama")
    assert "| tiny-llama | — |" in (out / "eval.md").read_text()
    monkeypatch.chdir(work / "lora")
    main(["--model", "../tiny-llama", "--adapter", ".", *args])
    out = work / "lora" / "runs" / "eval" / "tiny-llama-lora-arithmetic-test"
    result = json.loads((out / "eval.json").read_text())
    assert result["settings"]["adapter"]["path"] == str(work / "lora")
    assert "| tiny-llama | lora |" in (out / "eval.md").read_text()


def test_an_earlier_eval_json_is_replaced_only_with_overwrite(tiny_dir, tmp_path, monkeypatch):
    """``qerl eval --output DIR`` where DIR holds an earlier evaluation's eval.json replaced it without a word (its
    settings and records lost); now a one-line UsageError naming the folder and --overwrite, before the model loads,
    the earlier files untouched; ``--overwrite`` replaces them (as nvfp4-quantize's --overwrite)."""
    import qerl_trl.evaluation

    first, _ = _run(tmp_path, "out", "--model", str(tiny_dir), "--greedy")
    before = {name: (tmp_path / "out" / name).read_bytes() for name in ("eval.json", "eval.md")}
    load = qerl_trl.evaluation.load_model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(qerl_trl.evaluation, "load_model", no_model)
    with pytest.raises(UsageError, match=r"^--output '.*out' holds the eval.json / eval.md of an earlier evaluation: "
                       r"pass --overwrite to replace them, or give another --output$") as info:  # fmt: skip
        _run(tmp_path, "out", "--model", str(tiny_dir), "--greedy", "--seed", "1")
    assert "\n" not in str(info.value)
    assert {name: (tmp_path / "out" / name).read_bytes() for name in before} == before
    monkeypatch.setattr(qerl_trl.evaluation, "load_model", load)
    second, _ = _run(tmp_path, "out", "--model", str(tiny_dir), "--greedy", "--seed", "1", "--overwrite")
    assert first["settings"]["seed"] == 0 and second["settings"]["seed"] == 1


def test_eval_engines_are_the_registrys_engines_that_evaluate(tiny_dir, tmp_path, capsys):
    """``qerl eval --help`` listed ``--engine {transformers,graph,vllm}`` (every rollout engine), but the graph engine
    generates for training only: ``--engine graph`` was refused once parsed. The choices are now the registry's
    engines that evaluate, and ``--engine graph`` is an argument error saying which engines evaluate."""
    from qerl_trl.cli import main as qerl
    from qerl_trl.evaluation import build_parser
    from qerl_trl.rollout import ENGINES, evaluation_engines

    assert evaluation_engines() == ["transformers", "vllm"] and "graph" in ENGINES
    assert "--engine {transformers,vllm}" in build_parser().format_help()
    with pytest.raises(SystemExit) as info:
        qerl(["eval", "--model", str(tiny_dir), "--task", "arithmetic", "--engine", "graph",
              "--output", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err == ("qerl eval: error: argument --engine: must be one of 'transformers', "
                                            "'vllm', got 'graph' ('graph' generates for qerl train only)")  # fmt: skip


def test_an_adapter_on_another_quantization_or_model_than_its_run_is_one_line_before_the_model_loads(
        tiny_dir, adapter_dir, tmp_path, monkeypatch):  # fmt: skip
    """``qerl eval --adapter <run>/final`` of a run trained with --quantization nvfp4-rtn, asked with the default
    (none, bf16) or nvfp4-mse, or on another model of the same shapes, loaded the adapter onto that other policy and
    measured it without a word. The run folder's recipe.yaml (qerl train's record, which --resume checks) names both:
    one line naming the saved value and the requested one, before the model loads. The same values in another
    spelling (an alias), an adapter without a record, and an already quantized --model (whose quantization is in its
    weights) go on to load."""
    import shutil

    import qerl_trl.evaluation
    from nvfp4 import NVFP4Config
    from qerl_trl.cli import TrainInvocation, parse_train_args, run_recipe
    from transformers import AutoModelForCausalLM

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(qerl_trl.evaluation, "load_model", no_model)
    run = tmp_path / "run"
    made = ["--model_name_or_path", str(tiny_dir), "--output_dir", str(run)]
    shutil.copytree(adapter_dir, run / "final")
    invocation = TrainInvocation.from_argv(made)
    (run / "recipe.yaml").write_text(run_recipe(invocation, *parse_train_args(invocation)))
    args = ["--adapter", str(run / "final"), "--task", "arithmetic", "--limit", "1", "--output", str(tmp_path / "out")]
    head = f"--adapter '{run / 'final'}': the run in '{run}' (recipe.yaml) was trained"
    for asked in ([], ["--quantization", "nvfp4-mse"]):
        with pytest.raises(UsageError) as info:
            main(["--model", str(tiny_dir), *asked, *args])
        err = str(info.value)
        assert err.startswith(f"{head} with --quantization 'nvfp4-rtn', this evaluation asks for "
                              f"'{asked[1] if asked else 'none'}': ") and "\n" not in err, err  # fmt: skip
        assert err.endswith("pass --quantization nvfp4-rtn to evaluate it"), err
    other = tmp_path / "other-model"
    shutil.copytree(tiny_dir, other)  # another model, the same shapes
    with pytest.raises(UsageError) as info:
        main(["--model", str(other), "--quantization", "nvfp4-rtn", *args])
    err = str(info.value)
    assert err.startswith(f"{head} on --model_name_or_path '{tiny_dir}', this evaluation asks for --model "
                          f"'{other}': ") and err.endswith(f"pass --model {tiny_dir} to evaluate it"), err  # fmt: skip
    with pytest.raises(AssertionError, match="the model was loaded"):  # an alias of the run's: the same policy
        main(["--model", str(tiny_dir), "--quantization", "rtn", *args])
    with pytest.raises(AssertionError, match="the model was loaded"):  # no record: nothing to compare
        main(["--model", str(other), "--adapter", str(adapter_dir), *args[2:]])
    quantized = tmp_path / "quantized"
    AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16, quantization_config=NVFP4Config(method="rtn")).save_pretrained(
        quantized)
    for f in tiny_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, quantized)
    with pytest.raises(AssertionError, match="the model was loaded"):
        main(["--model", str(quantized), *args])
