"""The shipped configs (``configs/``) install as the data package ``megatron_ring.configs``."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["megatron_ring*"]) + ["megatron_ring.configs"])
