"""Every internal of megatron_ring.integrations.megatron.on_cpu's tables exists in the installed megatron-core
with the parameters its patch was written for, and enabling the patches is idempotent and reversible.

Runs in the test process (one process, no ranks); the patches are put back as they were found.
"""
from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("megatron.core")

from megatron_ring.integrations.megatron import on_cpu  # noqa: E402


@pytest.fixture
def as_found(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Patches off for the test, then as they were before it."""
    monkeypatch.delenv(on_cpu.UNCHECKED_ENV, raising=False)
    was_enabled = on_cpu.megatron_on_cpu_enabled()
    on_cpu.disable_megatron_on_cpu()
    try:
        yield
    finally:
        on_cpu.disable_megatron_on_cpu()
        if was_enabled:
            on_cpu.enable_megatron_on_cpu()


def test_the_installed_version_is_checked() -> None:
    assert on_cpu.check_megatron_version(on_cpu.installed_megatron_version())


@pytest.mark.parametrize("patch", on_cpu.PATCHES + on_cpu.CUDA_STAND_INS, ids=lambda p: p.name)
def test_every_listed_internal_exists_with_its_parameters(patch: on_cpu.Patch) -> None:
    (target,) = on_cpu.check_patches((patch,), on_cpu.installed_megatron_version())
    assert target[1] == patch.attribute.rpartition(".")[2]


def test_enable_is_idempotent_and_disable_puts_every_original_back(as_found: None) -> None:
    def current() -> list[object]:
        return [target[2] for target in on_cpu.check_patches(on_cpu.PATCHES, "installed")]

    originals = current()
    on_cpu.enable_megatron_on_cpu()
    patched = current()
    on_cpu.enable_megatron_on_cpu()
    assert current() == patched
    assert all(a is not b for a, b in zip(originals, patched) if not isinstance(a, bool))
    on_cpu.disable_megatron_on_cpu()
    assert all(a is b for a, b in zip(originals, current()))


def test_a_changed_signature_is_refused_before_anything_is_patched(
        as_found: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.fusions import fused_softmax

    original = fused_softmax.get_sliding_window_causal_mask
    monkeypatch.setattr(fused_softmax, "get_sliding_window_causal_mask", lambda sq, skv, window, extra=None: None)
    with pytest.raises(on_cpu.MegatronCompatibilityError,
                       match=r"get_sliding_window_causal_mask takes \(sq, skv, window, extra\), but .* written for "
                             r"\(sq, skv, window_size\)"):
        on_cpu.enable_megatron_on_cpu()
    assert not on_cpu.megatron_on_cpu_enabled()
    monkeypatch.setattr(fused_softmax, "get_sliding_window_causal_mask", original)


def test_the_opt_in_patches_an_unknown_version_with_a_warning(
        as_found: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(on_cpu, "installed_megatron_version", lambda: "0.19.0")
    monkeypatch.setenv(on_cpu.UNCHECKED_ENV, "1")
    with pytest.warns(UserWarning, match="patching anyway"):
        on_cpu.enable_megatron_on_cpu()
    assert on_cpu.megatron_on_cpu_enabled()
