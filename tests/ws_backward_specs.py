"""Spec text of a warp-specialized backward for the host tests of its modifications: the tuned schedule of each head
dim (dispatch/backward.BACKWARD_WS_TUNED), with the forward schedule d256 needs beside it."""
from __future__ import annotations

from tiledsl.dispatch.backward import BACKWARD_WS_TUNED
from tiledsl.frontend.parse import parse_text

SPEC = """attention {name} {{
    head_dim = {d}
    dtype    = bf16
    mask     = {mask}
{mods}
    backward {{
        order      kv, q
        tile       q = {tq}, kv = {tk}
        warpgroups producer 1 regs 24, consumer 2 regs 240
        pipeline   {stages} stages via tma
        dq accumulate {dq}
    }}
}}
"""
# (tile q, tile kv, stages) of each head dim's tuned warp-specialized backward
TILES = {d: (b.tile_q, b.tile_kv, b.stages) for d, b in BACKWARD_WS_TUNED.items()}
D256_FORWARD = """    schedule {
        tile     q = 64, kv = 32
        warps    4 along q
        pipeline 1 stage via cp.async
    }"""


def spec_text(name: str, mods: list[str], d: int = 128, mask: str = "causal", dq: str = "tma_reduce") -> str:
    """The spec `name` with the modification lines `mods` (indented here) on head dim d's tuned tiles."""
    tq, tk, stages = TILES[d]
    lines = "\n".join("    " + line for line in mods) + ("\n" + D256_FORWARD if d == 256 else "")
    return SPEC.format(name=name, d=d, mask=mask, mods=lines, tq=tq, tk=tk, stages=stages, dq=dq)


def ws_spec(name: str, mods: list[str], d: int = 128, mask: str = "causal", dq: str = "tma_reduce"):
    (s,) = parse_text(spec_text(name, mods, d, mask, dq), f"<{name}>")
    return s
