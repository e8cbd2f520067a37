"""benchmarks/generate.py's --inductor: KEY=VALUE settings of torch._inductor.config for the compiled decode rows,
parsed as each setting's type; an unknown key stops the script before anything runs, naming it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_inductor_settings_are_typed_and_set():
    import torch._inductor.config as config
    from generate import inductor_settings

    # config.patch restores them after (pytest's monkeypatch would delete them: a config module is no plain module)
    with config.patch(freezing=False, combo_kernels=True):
        errors = []
        assert inductor_settings("freezing=1,combo_kernels=false", errors.append) == {"freezing": True, "combo_kernels": False}
        assert config.freezing is True and config.combo_kernels is False and not errors
        assert inductor_settings("", errors.append) == {}
    assert config.freezing is False  # the default again


def test_an_unknown_inductor_setting_is_refused_by_name(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--small", "--out", str(tmp_path),
                          "--inductor", "freezing=1,no_such_setting=3"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "--inductor no_such_setting: torch._inductor.config has no such setting" in res.stderr
    assert not (tmp_path / "generate.json").exists()
