"""Package discovery only (the metadata is in pyproject.toml).

The catalogue lives in the top-level ``schedules/`` folder (one idea per file, outside the
package so it reads as data); it is installed as ``cute_fp4/schedules``, which
``cute_fp4.catalogue.builtin_dir`` finds in a wheel as well as in a source checkout.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["cute_fp4", "cute_fp4.*"]), "cute_fp4.schedules"],
      package_dir={"cute_fp4.schedules": "schedules"})
