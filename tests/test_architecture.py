"""The structure issue #38 set up stays: counted from the source by ``tests/architecture_metrics.py``."""

from __future__ import annotations

from pathlib import Path

import architecture_metrics as am

ROOT = Path(__file__).resolve().parents[1]
#: where a ``quantization`` string enters: the train config (CLI, YAML, Python), qerl train's check before TRL is
#: imported, qerl eval's option and its Python loader, and load_policy for Python callers
PARSE_ENTRY_POINTS = {"qerl_trl/config.py", "qerl_trl/cli.py", "qerl_trl/evaluation.py", "qerl_trl/policy.py"}


def test_quantization_strings_are_parsed_at_the_entry_points_only():
    sites = {s.split(":")[0].split("/src/")[-1] for s in am.parse_sites(ROOT)}
    assert sites <= PARSE_ENTRY_POINTS, sites - PARSE_ENTRY_POINTS


def test_no_format_name_comparisons_outside_the_registries():
    assert am.format_name_comparisons(ROOT) == []


def test_nvfp4_has_no_import_cycle():
    assert am.nvfp4_import_cycles(ROOT) == []


def test_no_private_names_imported_across_packages_or_by_benchmarks():
    assert am.private_imports(ROOT) == []


def test_benchmarks_hold_what_a_maintainer_reruns():
    assert am.benchmark_lines(ROOT) <= 3500
