"""Adding a rollout engine is one file (``toy_engine.py``) plus one registry line: ``qerl train`` runs through it, its
rules (``check_config``) apply, and ``qerl eval --engine`` offers it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset
from qerl_trl.cli import main
from qerl_trl.config import QeRLConfig
from qerl_trl.rollout import ENGINES
from qerl_trl.run import read_metrics


@pytest.fixture
def toy_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # toy_engine.py, beside this file
    monkeypatch.setitem(ENGINES, "toy", "toy_engine:ToyRollout")  # the one registry line
    from toy_engine import ToyRollout

    ToyRollout.generations.clear()
    ToyRollout.trainings = 0
    return ToyRollout


def test_qerl_train_runs_through_a_registered_engine(tmp_path, tiny_dir, toy_engine, capsys):
    out = tmp_path / "run"
    main(["train", "offline-default", "--model_name_or_path", str(tiny_dir), "--output_dir", str(out),
          "--rollout_engine", "toy", "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "2",
          "--max_completion_length", "4", "--task_options", json.dumps({"n_examples": 8}), "--disable_tqdm", "true",
          "--save_strategy", "no"])  # fmt: skip
    assert "qerl train: 1 step " in capsys.readouterr().out
    assert toy_engine.trainings == 1 and len(toy_engine.generations) == 1  # one generation call: the step's batch
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1]


def test_the_engine_owns_its_rules(tmp_path, toy_engine, monkeypatch):
    cfg = QeRLConfig(output_dir=str(tmp_path), rollout_engine="toy")
    assert cfg.rollout_engine_class is toy_engine
    with pytest.raises(ValueError, match="'toy' decodes greedily and cannot honour top_k"):
        QeRLConfig(output_dir=str(tmp_path), rollout_engine="toy", top_k=5)
    from qerl_trl.evaluation import build_parser
    from qerl_trl.validation import UsageError

    # qerl eval --engine takes the registered engines that evaluate (that say so in check_evaluation)
    with pytest.raises(UsageError, match=r"got 'toy' \('graph', 'toy' generate for qerl train only\)$"):
        build_parser().parse_args(["--engine", "toy"])
    monkeypatch.setattr(toy_engine, "check_evaluation", classmethod(lambda cls, scheme: None))
    assert build_parser().parse_args(["--engine", "toy"]).engine is toy_engine


def test_an_engine_that_does_not_say_how_it_holds_generation_memory_is_refused(tmp_path, monkeypatch):
    """The memory plan reads ``holds_generation_memory``: an engine without it fails at config time, not silently."""
    from qerl_trl.rollout.base import RolloutEngine

    class Unsaid(RolloutEngine):
        name = "unsaid"

    monkeypatch.setattr("qerl_trl.config.engine_class", lambda name: Unsaid)
    with pytest.raises(TypeError, match="Unsaid must set holds_generation_memory"):
        QeRLConfig(output_dir=str(tmp_path), rollout_engine="unsaid")


@pytest.mark.parametrize("correction", [None, "true"])
def test_an_engine_with_sampling_logprobs_gets_trls_sampling_correction(
    tmp_path, tiny_dir, toy_engine, monkeypatch, correction
):
    """An engine that returns its sampling logprobs (vLLM's case) is driven through the interface only: its adapter once
    per step (``sync_lora``), its ``generate``; no TRL engine is planted in the trainer, and TRL's importance-sampling
    correction runs on the engine's logprobs (here the policy's own: ratio 1), from the loss forward (deferred). Under
    AQN the correction is off by default, and the gap and the ratio are logged all the same; set, it is on."""
    from qerl_trl.cli import parse_train_args, train

    monkeypatch.setitem(ENGINES, "toy-logprobs", "toy_engine:SamplingToyRollout")
    from toy_engine import SamplingToyRollout

    SamplingToyRollout.synced.clear()
    argv = ["offline-default", "--model_name_or_path", str(tiny_dir), "--output_dir", str(tmp_path / "run"),
            "--rollout_engine", "toy-logprobs", "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--num_generations", "2", "--max_completion_length", "4", "--task_options", json.dumps({"n_examples": 8}),
            "--disable_tqdm", "true", "--save_strategy", "no", "--logging_steps", "1"]  # fmt: skip
    if correction is not None:
        argv += ["--vllm_importance_sampling_correction", correction]
    trainer = train(*parse_train_args(argv))
    assert trainer.vllm_importance_sampling_correction is (correction is not None)
    assert SamplingToyRollout.synced == [0, 1] and len(toy_engine.generations) == 2
    assert not hasattr(trainer, "vllm_generation") and not hasattr(trainer, "_last_loaded_step")
    assert trainer._defers_sampling_correction()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    # step 0 is noise-free; at step 1 AQN's noise is on the policy while the toy engine generates from it
    assert steps[0]["sampling/sampling_logp_difference/mean"] < 1e-5, steps[0]
    assert steps[0]["aqn/sigma"] == 0 < steps[1]["aqn/sigma"] and steps[1]["sampling/sampling_logp_difference/mean"] > 0
    assert all(abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-2 for h in steps), steps


def test_an_engine_with_sampling_logprobs_refuses_trls_rollout_func(tmp_path, tiny_dir, monkeypatch):
    """TRL's rollout_func (and tool) paths would look for TRL's own vLLM engine once its correction is on."""
    from qerl_trl.config import QeRLConfig
    from qerl_trl.trainer import QeRLGRPOTrainer

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setitem(ENGINES, "toy-logprobs", "toy_engine:SamplingToyRollout")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    args = QeRLConfig(output_dir=str(tmp_path), rollout_engine="toy-logprobs", per_device_train_batch_size=2,
                      num_generations=2, report_to="none")  # fmt: skip
    with pytest.raises(ValueError, match="'toy-logprobs' does not support TRL's tools, environment_factory or rollout_func"):
        QeRLGRPOTrainer(str(tiny_dir), lambda completions, **kw: [0.0] * len(completions), args,
                        train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), rollout_func=lambda p, t: {})  # fmt: skip


def test_a_missing_vllm_stops_before_the_policy_loads(tmp_path):
    """``rollout_engine="vllm"`` (colocate) where vLLM is not installed: one ``MissingExtraError`` naming the pip line,
    raised by the engine's ``check_environment`` before any weight is read (the model path does not even exist); a
    server needs nothing here."""
    import importlib.util

    from nvfp4.extras import MissingExtraError
    from qerl_trl.config import QeRLConfig
    from qerl_trl.rollout.vllm import VLLMRollout
    from qerl_trl.trainer import QeRLGRPOTrainer

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment (the main one has none: its tests run in .venv-vllm)")
    args = QeRLConfig(output_dir=str(tmp_path), rollout_engine="vllm", report_to="none")
    with pytest.raises(MissingExtraError, match=r"needs vLLM and qerl-vllm: pip install 'qerl-vllm\[vllm\]'$"):
        QeRLGRPOTrainer(str(tmp_path / "no-such-model"), lambda completions, **kw: [0.0] * len(completions), args)
    VLLMRollout.check_environment(QeRLConfig(output_dir=str(tmp_path), rollout_engine="vllm",
                                             vllm={"server_url": "http://127.0.0.1:8000"}, report_to="none"))  # fmt: skip


def test_qerl_eval_on_a_missing_vllm_stops_before_the_model_loads(tmp_path, capsys):
    """``qerl eval --engine vllm`` where vLLM is not installed: the engine's ``check_evaluation`` stops it in one line
    (the pip line, exit 2) before any model is read (the model path does not even exist)."""
    import importlib.util

    from qerl_trl.cli import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment (the main one has none: its tests run in .venv-vllm)")
    with pytest.raises(SystemExit) as info:
        main(["eval", "--model", str(tmp_path / "no-such-model"), "--task", "arithmetic", "--engine", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert err[0] == "qerl eval: error: qerl eval --engine vllm needs vLLM and qerl-vllm: pip install 'qerl-vllm[vllm]'"


def test_qerl_train_on_a_missing_vllm_stops_before_the_data_loads(tmp_path, capsys):
    """``qerl train --rollout_engine vllm`` where vLLM is not installed: one line (the pip line, exit 2) as soon as the
    config is parsed, before the training set, the memory plan or the policy."""
    import importlib.util

    from qerl_trl.cli import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment (the main one has none: its tests run in .venv-vllm)")
    with pytest.raises(SystemExit) as info:
        main(["train", "--rollout_engine", "vllm", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1, err
    assert err[0] == ("qerl train: error: rollout_engine='vllm' colocated (or set vllm.server_url for a server) needs "
                      "vLLM and qerl-vllm: pip install 'qerl-vllm[vllm]'")
    assert not (tmp_path / "run").exists()


def test_an_unreachable_vllm_server_is_named_in_the_error(tmp_path):
    """``vllm.server_url`` pointing where no server listens: the error names the URL and the request (urllib's own
    says only ``<urlopen error [Errno 111] Connection refused>``)."""
    import socket
    from types import SimpleNamespace

    from qerl_trl.rollout.vllm import ServerVLLMGeneration

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match=rf"vLLM server GET {url}/v1/models: .*[Cc]onnection refused.*vllm\.server_url"):
        ServerVLLMGeneration(trainer, url, timeout=5)


def test_a_server_url_that_is_no_vllm_server_is_one_line_naming_it(tmp_path):
    """``vllm.server_url`` pointing at another HTTP server (here a static-file server): the error is one line naming
    the URL, whether it answers 404 with an HTML page (which went into the message, newlines and all) or 200 with
    something that is no model list (a ``TypeError`` on a string before)."""
    import functools
    import http.server
    import threading
    from types import SimpleNamespace

    from qerl_trl.rollout.vllm import ServerVLLMGeneration

    files = tmp_path / "www"
    files.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(files))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path / "run")))
    try:
        with pytest.raises(RuntimeError, match=rf"^vLLM server GET {url}/v1/models: HTTP 404: ") as info:
            ServerVLLMGeneration(trainer, url, timeout=5)
        assert "\n" not in str(info.value)
        (files / "v1").mkdir()
        (files / "v1" / "models").write_text("<html>\n<body>not vLLM</body>\n</html>\n")
        with pytest.raises(RuntimeError, match=rf"^vLLM server GET {url}/v1/models: no model list .*vllm\.server_url"):
            ServerVLLMGeneration(trainer, url, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
