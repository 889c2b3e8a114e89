"""The package metadata builds without a warning of ours: setuptools' deprecation of
`project.license` as a TOML table, printed by `make install` of a fresh checkout, stays away."""

from __future__ import annotations

import tomllib
import warnings

from tests.support.paths import REPO


def test_pyproject_applies_without_a_deprecation_warning():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), REPO / "pyproject.toml")
    ours = [str(w.message).splitlines()[0] for w in caught if "setuptools" in w.category.__module__]
    assert ours == []
    assert distribution.metadata.license_expression == "Apache-2.0"


def test_the_build_requires_a_setuptools_that_reads_an_spdx_license():
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    assert "setuptools>=77" in build["requires"]
