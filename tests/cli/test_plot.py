"""`longtrain plot`: loss curves of real runs into a PNG."""

from __future__ import annotations

import matplotlib.image
import numpy as np

from tests.train.tiny import cli


def test_plot_draws_several_runs_into_a_png(workspace, tmp_path):
    tmp, recipe = workspace
    path = recipe(steps=4, every=100)
    for name, lr in (("lr-3e-3", "3e-3"), ("lr-1e-3", "1e-3")):
        assert cli("fit", path, "--run-dir", tmp / name, "--set", f"train.lr={lr}").exit_code == 0
    out = tmp_path / "curves.png"
    r = cli("plot", tmp / "lr-3e-3", tmp / "lr-1e-3", "--out", out)
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (540, 1440)  # 12 x 4.5 inches at 120 dpi: two panels
    for rgb in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):  # each run's curve, in its colour (C0, C1), left panel
        left = image[:, : image.shape[1] // 2, :3]
        close = (abs(left - np.array(rgb) / 255).max(-1) < 0.08).sum()
        assert close > 300, (rgb, close)  # a line across the panel, not the legend's swatch alone (~60 pixels)
    assert cli("plot", tmp / "lr-3e-3", "--x", "step", "--out", tmp_path / "steps.svg").exit_code == 0


def test_plot_names_what_is_wrong(tmp_path):
    r = cli("plot", tmp_path, "--out", tmp_path / "x.png")  # a folder, nothing in it to plot
    assert r.exit_code == 1 and "has no metrics.jsonl" in r.output
    r = cli("plot", tmp_path / "nope", "--out", tmp_path / "x.png")
    assert r.exit_code == 2 and "nope does not exist" in r.output
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens": 10}\n')
    r = cli("plot", tmp_path, "--out", tmp_path / "x.txt")
    assert r.exit_code == 2 and "ending in .png" in r.output
    r = cli("plot", tmp_path, "--out", tmp_path / "missing" / "x.png")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = cli("plot", tmp_path, "--out", tmp_path / "x.png", "--x", "time")
    assert r.exit_code == 2 and "x must be one of tokens, step" in r.output
