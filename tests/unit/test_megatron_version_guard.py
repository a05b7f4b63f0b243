"""The version guard of Megatron on CPU (Note [Megatron-core on CPU] in integrations/megatron/on_cpu.py),
without importing megatron-core: the installed version is monkeypatched. That every listed internal
exists in the installed megatron-core is tests/integration/test_megatron_on_cpu.py.
"""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from megatron_ring.integrations.megatron import on_cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(on_cpu.UNCHECKED_ENV, raising=False)


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.16.2rc0"])
def test_a_checked_version_passes(version: str) -> None:
    assert on_cpu.check_megatron_version(version) is True


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "0.19.0", "1.16.0", "main"])
def test_an_unknown_version_is_refused_naming_both(version: str) -> None:
    with pytest.raises(on_cpu.MegatronCompatibilityError) as err:
        on_cpu.check_megatron_version(version)
    message = str(err.value)
    assert f"megatron-core {version} is installed" in message
    assert ">=0.16,<0.17" in message and on_cpu.UNCHECKED_ENV in message


def test_the_opt_in_patches_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(on_cpu.UNCHECKED_ENV, "1")
    with pytest.warns(UserWarning, match=r"megatron-core 0\.19\.0 is installed.*patching anyway"):
        assert on_cpu.check_megatron_version("0.19.0") is False


def test_a_bad_opt_in_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(on_cpu.UNCHECKED_ENV, "yes")
    with pytest.raises(ValueError, match=r"MEGATRON_RING_UNCHECKED_MEGATRON='yes': allowed values are 1"):
        on_cpu.check_megatron_version("0.19.0")


def test_enabling_refuses_an_unknown_installed_version_and_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(on_cpu, "installed_megatron_version", lambda: "0.19.0")
    monkeypatch.setattr(on_cpu, "_ORIGINALS", [])
    with pytest.raises(on_cpu.MegatronCompatibilityError, match=r"megatron-core 0\.19\.0 is installed"):
        on_cpu.enable_megatron_on_cpu()
    assert not on_cpu.megatron_on_cpu_enabled()


def test_the_table_lists_checked_versions_inside_the_guarded_range() -> None:
    for patch in on_cpu.PATCHES + on_cpu.CUDA_STAND_INS:
        assert patch.why and patch.checked_on, patch.name
        for version in patch.checked_on:
            assert on_cpu.check_megatron_version(version), (patch.name, version)
    names = [p.name for p in on_cpu.PATCHES + on_cpu.CUDA_STAND_INS]
    assert len(names) == len(set(names))


def test_setup_cfg_requires_the_guarded_range() -> None:
    """The package's megatron-core requirement is the range the patches were checked on."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    found = {name: re.findall(r"^megatron-core(.*)$", extras[name], flags=re.MULTILINE)
             for name in extras if "megatron-core" in extras[name]}
    assert set(found) == {"megatron", "all"}
    assert all(specs == [on_cpu.checked_range_text()] for specs in found.values()), found
