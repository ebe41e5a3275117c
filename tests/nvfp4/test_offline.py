"""``nvfp4.offline.cache_dir``: where converted checkpoints live."""

from __future__ import annotations

from pathlib import Path

from nvfp4.offline import cache_dir


def test_cache_dir_expands_a_home_relative_qerl_cache(monkeypatch, tmp_path):
    """``QERL_CACHE='~/qerl-cache'`` (quoted in a shell, or set from Python) was a folder named ``~`` in the working
    directory; it is the user's home, as the default ``~/.cache/qerl`` is."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("QERL_CACHE", "~/qerl-cache")
    assert cache_dir() == tmp_path / "qerl-cache"
    monkeypatch.delenv("QERL_CACHE")
    assert cache_dir() == Path(tmp_path) / ".cache" / "qerl"
