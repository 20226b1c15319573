"""tiledsl.tune.bench helpers that run without a GPU: source patches of A/B experiments fail loudly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tiledsl.tune.bench import patch_source


def test_patch_applies_when_its_target_occurs_once():
    kernel = SimpleNamespace(name="k", source="a; b; c;")
    patch_source(kernel, [("b;", "B;"), ("c;", "C;")])
    assert kernel.source == "a; B; C;"


@pytest.mark.parametrize("source", ["a; c;", "b; b;"])
def test_patch_whose_target_is_gone_or_ambiguous_raises(source):
    kernel = SimpleNamespace(name="k", source=source)
    with pytest.raises(ValueError, match="patch target found"):
        patch_source(kernel, [("b;", "B;")])
    assert kernel.source == source
