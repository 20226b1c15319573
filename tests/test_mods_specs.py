"""The bundled examples of every modification (specs/mods/): each checks, explains, and runs in the float64
reference, forward and (where it has a backward) backward, with aux tensors of the shapes it documents."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tiledsl.cli.report import explain
from tiledsl.frontend.parse import load_specs
from tiledsl.reference.backward import reference_backward
from tiledsl.reference.forward import naive_attention, reference_attention

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "specs" / "mods").glob("*.tile"))
BATCH, HEADS, N = 2, 2, 300


def aux_for(spec, rng):
    shapes = {"alibi_slopes": (HEADS,), "sinks": (HEADS,), "bias": (HEADS, 8191), "t5": (HEADS, 32),
              "rel_bias": (HEADS, 16383), "seq_slope": (BATCH, HEADS)}
    out = {}
    for aux in spec.problem.mods.user_aux():
        if aux.name in ("document_ids", "doc"):   # doc: expressions_d128.tile's document mask_mod
            out[aux.name] = np.sort(rng.integers(0, 5, (BATCH, N)), axis=1)
        elif aux.name == "document_bounds":
            out[aux.name] = np.array([[0, 40, 40, 200, N], [0, 10, 90, N, N]])
        elif aux.name == "block_mask":
            out[aux.name] = rng.integers(0, 2, (1, HEADS, 3, 3))
        else:
            out[aux.name] = rng.normal(0, 1, shapes[aux.name])
    if spec.problem.mods.dropout is not None:
        out["dropout_rng"] = (7, 3)
    return out


def test_every_modification_has_an_example():
    mods = [spec.problem.mods for path in EXAMPLES for spec in load_specs(path)]
    for field in ("softcap", "alibi", "document", "prefix", "blocks", "dropout", "score_mod", "mask_mod"):
        assert any(getattr(m, field) is not None for m in mods), field
    assert any(m.sinks for m in mods)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_explains_and_runs_in_the_reference(path):
    rng = np.random.default_rng()
    for spec in load_specs(path):
        assert "score and mask modifications:" in explain(spec, seqlen_q=1024)
        d = spec.problem.head_dim_qk
        q, k, v = (rng.standard_normal((BATCH, HEADS, N, d)) for _ in range(3))
        aux = aux_for(spec, rng)
        o, lse = reference_attention(spec, q, k, v, aux=aux)
        assert np.isfinite(o).all() and not np.isnan(lse).any()
        plain, _ = naive_attention(q, k, v, spec.problem.mask, spec.problem.window_left, spec.problem.window_right)
        assert not np.allclose(o, plain)   # the modification changed something
        if spec.backward is not None:
            grads = reference_backward(spec, q, k, v, rng.standard_normal(o.shape), o, lse, aux=aux)
            assert all(np.isfinite(g).all() for g in grads)
