"""`fit --run-dir DIR` without a RECIPE goes on with that run's own recipe, not quickstart's (a fresh-clone trial:
a finished 20-step run resumed towards quickstart's 800 steps, its learning rate back in warm-up)."""

from longtrain.train.recipe import load_recipe

from .tiny import cli, logged_steps, workspace  # noqa: F401  (workspace: the tiny-run fixture)


def test_a_run_dir_without_a_recipe_resumes_with_its_own(workspace):
    tmp, recipe = workspace
    run = tmp / "r"
    assert cli("fit", recipe(steps=3, every=100), "--run-dir", run).exit_code == 0
    saved = (run / "recipe.yaml").read_text()

    r = cli("fit", "--run-dir", run)  # no RECIPE: the run's, finished at its 3 steps
    assert r.exit_code == 0, r.output
    assert f"recipe: {run / 'recipe.yaml'} (the run's own" in r.output
    assert "already finished at step 3 (train.steps is 3)" in r.output, r.output
    assert (run / "recipe.yaml").read_text() == saved and logged_steps(run) == [1, 2, 3]

    r = cli("fit", "--run-dir", run, "--set", "train.steps=5")  # extending it keeps the rest of its recipe
    assert r.exit_code == 0, r.output
    assert logged_steps(run) == [1, 2, 3, 4, 5]
    assert load_recipe(run / "recipe.yaml").data.path == load_recipe(recipe(steps=3, every=100)).data.path


def test_a_run_past_a_lowered_train_steps_says_so(workspace):
    tmp, recipe = workspace
    run = tmp / "r"
    assert cli("fit", recipe(steps=3, every=100), "--run-dir", run).exit_code == 0
    r = cli("fit", recipe(steps=3, every=100), "--run-dir", run, "--set", "train.steps=2")
    assert r.exit_code == 0, r.output
    assert "already past train.steps at step 3 (train.steps is 2)" in r.output, r.output
