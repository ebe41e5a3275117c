"""The GPU runbook (``benchmarks/vllm_gpu/README.md``) against the scripts it runs, on CPU, running nothing.

A device session has ~30 minutes and each command that fails on first contact costs minutes of it: every
``python3 benchmarks/....py`` command line in the README's code spans goes through its script's own argument
parser (and the model / arm name checks that follow it), every job started with ``bg.sh start`` names its results
under ``$JOB_OUT`` (what ``bg.tgz`` brings back: anything else stays in the job's copy of the tree), and every test
file or node id the README and the job scripts name exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "benchmarks" / "vllm_gpu" / "README.md"
PROFILE_DOC = REPO / "docs" / "fp8_rollouts.md"  # item 9's calls: its fenced blocks (its inline spans are history)
#: what a ``$NAME`` of a device command stands for here (any other must be defined in the same code span)
PLACES = {"JOB_OUT": "/tmp/job", "OUT": "/tmp/out", "PYTHONPATH": "/tmp/site"}
#: options that name a result file or folder; a command with none of them writes no result (``--build-only``)
RESULT_OPTIONS = ("--out", "--json", "--png-dir")


def code_spans(text: str, inline: bool = True) -> list[str]:
    """Fenced blocks and inline code spans, line breaks inside them as spaces (the README wraps long commands)."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    rest = re.sub(r"```.*?```", " ", text, flags=re.S)
    return [re.sub(r"\s*\n\s*", " ", s) for s in fenced + (re.findall(r"`([^`]+)`", rest) if inline else [])]


def commands(span: str) -> list[tuple[str, list[str], bool]]:
    """``(script, argv, in a bg.sh job)`` of each ``python3 benchmarks/X.py ...`` in ``span``, its ``$VAR``s expanded
    from the span's ``VAR="..."`` and ``for VAR in A B; do`` (the first value); placeholders (``<...>``) skipped."""
    env = dict(PLACES)
    env.update(re.findall(r'\b(\w+)="([^"]*)"', span))
    env.update((k, v.split()[0]) for k, v in re.findall(r"\bfor (\w+) in ([^;]+);", span))
    jobs = [m.span() for m in re.finditer(r"bg\.sh start \S+ '[^']*'", span)]
    out = []
    for m in re.finditer(r"python3? (benchmarks/[\w/]+\.py)([^;'&|<>)]*)", span):
        line = re.sub(r"\s\d$", "", m.group(2))  # `... 2>&1`: the redirection's fd
        if span[m.end() : m.end() + 1] == "<":  # `--merge <it>`: a placeholder
            continue
        expanded = re.sub(r"\$\{?(\w+)\}?", lambda v: env[v.group(1)], line)
        in_job = any(a <= m.start() < b for a, b in jobs)
        out.append((m.group(1), shlex.split(expanded), in_job))
    return out


RUNBOOK = [c for s in code_spans(README.read_text()) + code_spans(PROFILE_DOC.read_text(), inline=False)
           for c in commands(s)]  # fmt: skip


class _Parsed(BaseException):
    pass


def _module(script: str):
    name = "runbook_" + re.sub(r"\W", "_", script)
    if name not in sys.modules:
        sys.path.insert(0, str((REPO / script).parent))
        spec = importlib.util.spec_from_file_location(name, REPO / script)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_the_runbook_has_commands_to_check():
    scripts = {s for s, _, _ in RUNBOOK}
    assert {"benchmarks/gemm.py", "benchmarks/learning_study.py", "benchmarks/rollout_vllm.py",
            "benchmarks/grpo_step.py", "benchmarks/rollout.py"} <= scripts, scripts  # fmt: skip


@pytest.mark.parametrize("script,argv,in_job", RUNBOOK, ids=[f"{s} {' '.join(a)}"[:90] for s, a, _ in RUNBOOK])
def test_runbook_command_parses(script, argv, in_job, monkeypatch):
    """The script's own parser takes the command line (an unknown option or a bad value ends it with rc 2 there),
    then the names it checks before running anything: models, arms, lengths."""
    mod = _module(script)
    seen = {}

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error("unrecognized arguments: " + " ".join(extra))
        seen.update(ap=self, ns=ns)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    takes_argv = mod.main.__code__.co_argcount > 0
    with pytest.raises(_Parsed):
        mod.main(argv) if takes_argv else mod.main()
    ap, ns = seen["ap"], seen["ns"]
    if getattr(ns, "table", None) or getattr(ns, "merge", None):
        return
    if hasattr(mod, "models_and_arms"):  # rollout.py, rollout_vllm.py
        mod.models_and_arms(ap, ns, mod.ARMS)
    elif hasattr(mod, "check_names"):  # grpo_step.py
        mod.check_names(ap, ns.models.split(","), mod.MODELS, "model")
        mod.check_names(ap, ns.arms.split(","), mod.ARMS, "arm")
    elif hasattr(mod, "MODELS") and hasattr(ns, "models"):  # gemm.py
        assert set(ns.models.split(",")) <= set(mod.MODELS), ns.models


@pytest.mark.parametrize("script,argv", [(s, a) for s, a, job in RUNBOOK if job],
                         ids=[f"{s} {' '.join(a)}"[:90] for s, a, job in RUNBOOK if job])  # fmt: skip
def test_a_jobs_results_are_under_job_out(script, argv):
    """``bg.sh wait`` packs ``/tmp/qerl-bg`` (``$JOB_OUT``s) into ``bg.tgz``; a result written by default into the
    checkout lands in the job's copy of the tree, which does not come back."""
    named = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in RESULT_OPTIONS]
    if "--build-only" in argv:
        return
    assert named and all(p.startswith(PLACES["JOB_OUT"]) for p in named), (script, argv)


def test_named_tests_exist():
    """Test files and node ids in the README and the job scripts (a wrong one: pytest's rc 4, a call for nothing)."""
    texts = [README] + sorted((REPO / "benchmarks" / "vllm_gpu").glob("*.sh"))
    named = {m for t in texts for m in re.findall(r"tests/[\w/]+\.py(?:::\w+)?", t.read_text())}
    assert named
    for node in named:
        path, _, name = node.partition("::")
        assert (REPO / path).is_file(), node
        assert not name or re.search(rf"^def {name}\b", (REPO / path).read_text(), flags=re.M), node
