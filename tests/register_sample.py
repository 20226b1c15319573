"""Shared by tests/test_register_estimates.py and bench/register_estimates.py: the kernels whose ptxas register
counts hold the layouts' register ranges (Layout.ptxas_registers): every bundled kernel (backward main kernels
included) and a seeded sample of legal configs of every family, drawn from the spaces below."""
from __future__ import annotations

import random
from itertools import product

from tiledsl.codegen.render import render
from tiledsl.families import layout_of, lower
from tiledsl.frontend.parse import parse_text
from tiledsl.frontend.space import SpecSpace
from tiledsl.layout.backward import backward_has_template, backward_layout
from tiledsl.lower.backward import lower_backward

SEED = 2212

# A forward schedule every backward block below can sit under (the backward kernels are what is sampled).
_FORWARD = "order q, kv\n tile q = 64, kv = 32\n warps 4 along q\n pipeline 1 stage via cp.async"


def _block(name: str, problem: list[str], schedule: str, backward: str = "") -> str:
    back = f"    backward {{\n{backward}\n    }}\n" if backward else ""
    return (f"attention {name} {{\n" + "".join(f"    {line}\n" for line in problem)
            + f"    schedule {{\n{schedule}\n    }}\n{back}}}\n")


def _problems(head_dims, masks=("none", "causal"), dtypes=("bf16", "fp16"), extra=((),)) -> list[list[str]]:
    return [[f"head_dim = {d}", f"dtype = {t}", f"mask = {m}", *x]
            for d, m, t, x in product(head_dims, masks, dtypes, extra)]


# family -> (problems, schedule space, backward space or ""): what a template builds, with every setting varied
SPACES = {
    "fa1": (_problems((64, 128)), "order kv, q\n tile q in {32, 64}, kv in {32, 64, 128}\n"
            " warps in {2, 4} along in {q, kv}\n pipeline in {1, 2} stages via cp.async", ""),
    "fa2": (_problems((32, 64, 96, 128, 256), extra=((), ("kv_cache = paged(page = 64)",))),
            "order q, kv\n tile q in {64, 128}, kv in {32, 64, 128}\n warps in {4, 8} along q\n"
            " pipeline in {1, 2, 3} stages via cp.async", ""),
    "fa2_wgmma": (_problems((64, 128, 256)), "order q, kv\n tile q in {64, 128}, kv in {32, 64, 128, 176}\n"
                  " warps in {4, 8} along q\n pipeline in {1, 2, 3} stages via cp.async\n mma wgmma", ""),
    "decode": (_problems((64, 128, 256), masks=("none",), extra=(
        ("queries = 1",), ("queries = 4", "kv_cache = paged(page = 16)"), ("queries = 1", "kv_cache = paged(page = 64)"),
        ("queries = 16", "kv_dtype = e4m3", "kv_scale = per_head"), ("queries = 1", "kv_dtype = e4m3",
                                                                      "kv_scale = per_tensor"))),
        "order q, kv\n tile q = 16, kv in {64, 128, 256}\n warps in {1, 2, 4} along kv\n"
        " pipeline in {1, 2} stages via cp.async\n split kv in {1, auto}", ""),
    "hopper": (_problems((64, 128, 256), dtypes=("bf16",), extra=((), ("layout = varlen",))),
               "order q, kv\n tile q in {64, 128, 192}, kv in {64, 128, 176}\n"
               " warpgroups producer 1 regs in {24, 32}, consumer in {1, 2, 3}\n pipeline in {2, 3} stages via tma\n"
               " overlap pingpong in {on, off}, intra in {on, off}", ""),
    "backward": (_problems((64, 128), dtypes=("bf16",)), _FORWARD,
                 "order kv, q\n tile q in {16, 32, 64}, kv in {64, 128}\n warps in {4, 8}\n pipeline in {1, 2} stages\n"
                 " dq accumulate in {atomic, separate}"),
    "backward_wgmma": (_problems((64, 128), dtypes=("bf16",)), _FORWARD,
                       "order kv, q\n tile q in {64, 128}, kv = 128\n warps 8\n pipeline in {1, 2} stages\n"
                       " mma wgmma\n dq accumulate atomic"),
    "backward_ws": (_problems((64, 128, 256), dtypes=("bf16",)), _FORWARD,
                    "order kv, q\n tile q in {64, 128}, kv in {64, 128}\n"
                    " warpgroups producer 1 regs 24, consumer 2 regs 240\n pipeline in {1, 2} stages via tma\n"
                    " dq accumulate in {atomic, tma_reduce}"),
}


def legal_configs(family: str) -> list:
    """Every legal config of the family's spaces (a problem line set none of whose configs is legal adds none)."""
    problems, schedule, backward = SPACES[family]
    specs = []
    for i, problem in enumerate(problems):
        text = _block(f"{family}_{i}", problem, " " + schedule.replace("\n", "\n    "),
                      " " + backward.replace("\n", "\n    ") if backward else "")
        try:
            items = parse_text(text, f"{family}_{i}.tile")
        except Exception:   # noqa: BLE001 - a SpecError: no legal config of this problem (e.g. d256 fa1)
            continue
        for item in items:
            specs += item.expand()[0] if isinstance(item, SpecSpace) else [item]
    return specs


class Kernel:
    """One compiled function: its name, source, the layout whose range it must fall in, and what it is."""

    def __init__(self, what: str, spec, backward: bool):
        if backward:
            plan = lower_backward(spec)
            self.function, self.layout = plan.kernel_names["main"], backward_layout(spec).main
        else:
            plan = lower(spec)
            self.function, self.layout = spec.kernel_name, layout_of(spec)
        self.what, self.source = what, render(plan)


def sampled_kernels(per_family: int, seed: int = SEED) -> list[Kernel]:
    """`per_family` legal configs of every family, drawn with `seed` (the first per_family of a larger draw
    are the same kernels: the calibration sample contains the test's)."""
    out = []
    for family in SPACES:
        specs = legal_configs(family)
        random.Random(f"{seed}-{family}").shuffle(specs)
        out += [Kernel(family, s, family.startswith("backward")) for s in specs[:per_family]]
    return out


def bundled_kernels() -> list[Kernel]:
    """Every bundled forward kernel and every bundled backward module's main kernel."""
    from tests.test_codegen import generable_specs
    out = []
    for spec in generable_specs():
        out.append(Kernel("bundled", spec, False))
        if spec.backward is not None and not backward_has_template(spec):
            out.append(Kernel("bundled backward", spec, True))
    return out
