"""k3 train option resolution."""
import pytest


def test_compile_choice_resolves_per_device():
    from k3.train.trainer import resolve_compile
    assert resolve_compile("auto", "cpu") == "none"
    assert resolve_compile("auto", "cuda") == "modules"
    assert resolve_compile("layers", "cpu") == "layers"
    with pytest.raises(ValueError, match="compile"):
        resolve_compile("fast", "cpu")
