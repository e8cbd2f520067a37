"""Packaging beyond pyproject.toml: the built-in recipes ship inside the package.

`recipes/` stays at the top level of the repository (the one copy, where readers look for it);
here it is mapped to the package `longtrain.recipes`, so a regular (non-editable) install carries
it as `longtrain/recipes/*.yaml`. `longtrain.train.recipe` reads it there, or from the checkout.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["longtrain*"]) + ["longtrain.recipes"],
    package_dir={"longtrain.recipes": "recipes"},
    package_data={"longtrain.recipes": ["*.yaml"]},
)
