"""`tiledsl explain SPEC... --html OUT.html`: one self-contained page (inline SVG and a little JavaScript, no
network) with a step-through of every kernel of the specs and, for a search space, its configs' budgets and the
tune model's ranking followed by the step-through of the model's pick.

Every kernel is walked at one small shape shared by the whole page (trace.small_seqlen, or --html-seqlen), so two
specs explained together (`explain fa1.tile fa2.tile --html`) compare step for step; the real shape's traffic
(explain's --seqlen, --batch, --heads) is printed beside it. The drawing is cli/html_kernel.py's and
cli/html_space.py's; templates/explain_page.html.j2 spells it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import jinja2

from .common import read_items
from .html_kernel import KernelFigure
from .html_space import space_figure
from .report import blocks_per_sm, human, lowered
from ..codegen.render import TEMPLATE_DIR
from ..device_limits import H200
from ..errors import CliError, SpecError
from ..frontend.space import SpecSpace
from ..schedule.backward import build_backward_graph
from ..schedule.passes import run_passes
from ..schedule.trace import backward_trace, forward_trace, small_seqlen
from ..schedule.traffic import hbm_traffic

MAX_TILES_PER_AXIS = 64   # the step-through walks every (q tile, kv tile) pair: past this it is no longer readable
MAX_STEPS = 20000         # nor a page past this many steps


@dataclass(frozen=True)
class RealShape:
    batch: int
    heads: int
    kv_heads: int | None
    seqlen: int | None
    seqlen_kv: int | None

    def of(self, spec) -> tuple[int, int]:
        """explain's (seqlen q, seqlen kv) for `spec`: decode's --seqlen is its kv cache length."""
        queries = spec.problem.queries_per_seq
        if queries is not None:
            return queries, self.seqlen_kv or self.seqlen or 4096
        nq = self.seqlen or 4096
        return nq, self.seqlen_kv or nq


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                              autoescape=True, trim_blocks=True, lstrip_blocks=True)


def kernel_figures(fid: str, spec, seqlen: int, real: RealShape, pick_of: str = "") -> list[dict]:
    """The forward figure of `spec` (and its backward's, when it has one) at `seqlen` (SpecError when illegal)."""
    graph = run_passes(spec, H200)
    plan, _ = lowered(spec, H200, graph)
    per_sm = blocks_per_sm(spec, plan, H200)
    nq = spec.problem.queries_per_seq or seqlen
    trace = forward_trace(graph, nq, seqlen, per_sm)
    model = hbm_traffic(graph, 1, 1, nq, seqlen, blocks_per_sm=per_sm)
    rq, rk = real.of(spec)
    big = hbm_traffic(graph, real.batch, real.heads, rq, rk, real.kv_heads, blocks_per_sm=per_sm)
    title = f"{spec.name} · forward · {spec.kernel_name}" + (f" · the model's pick of {pick_of}" if pick_of else "")
    figures = [_kernel(fid, trace, spec, model, big, title, real, rq, rk)]
    if spec.backward is not None:
        bgraph = build_backward_graph(spec)
        btrace = backward_trace(spec, seqlen, seqlen)
        model = hbm_traffic(bgraph, 1, 1, seqlen, seqlen)
        big = hbm_traffic(bgraph, real.batch, real.heads, rq, rk)
        figures.append(_kernel(fid + "b", btrace, spec, model, big, f"{spec.name} · backward", real, rq, rk))
    return figures


def _kernel(fid, trace, spec, model, big, title, real, rq, rk) -> dict:
    totals = {"read": model.read_bytes, "write": model.write_bytes}
    figure = KernelFigure(fid, trace, spec, totals).figure()
    split = f", {trace.splits} splits" if trace.splits else ""
    figure.update(title=title, caption=(
        f"{trace.family} family; stepped at seqlen q {trace.seqlen_q}, kv {trace.seqlen_kv} (tiles {trace.tile_q} x "
        f"{trace.tile_kv}{split}), one (batch, head): {len(trace.steps)} steps, {human(model.read_bytes)} read and "
        f"{human(model.write_bytes)} written, as explain's traffic model counts it. At batch {real.batch} x heads "
        f"{real.heads}, seqlen q {rq}, kv {rk}: {human(big.read_bytes)} read, {human(big.write_bytes)} written."))
    return figure


def space_figure_and_pick(fid: str, space: SpecSpace, real: RealShape):
    """The space's budgets-and-ranking figure and the model's pick (None when no config is buildable)."""
    from ..families import layout_of
    from ..layout.backward import backward_layout
    from ..schedule.cost import Shape
    from ..tune import backward as tune_backward
    from ..tune.search import plan_candidates
    from .tune import short
    legal, _ = space.expand()
    if not legal:
        raise CliError(f"space '{space.name}' has no legal config to draw")
    rq, rk = real.of(legal[0])
    shape = Shape(real.batch, real.heads, rq, rk)
    backward = tune_backward.is_backward_space(space)
    plan = tune_backward.plan_backward_candidates if backward else plan_candidates
    candidates, rejected, budget = plan(space, shape)
    layouts = {c.name: backward_layout(c.spec).main if backward else layout_of(c.spec)
               for c in candidates if c.status != "illegal"}
    label = tune_backward.label if backward else short
    figure = space_figure(fid, space, shape, candidates, rejected, budget, label, layouts, backward)
    figure.update(title=f"{space.name} · search space")
    ranked = sorted((c for c in candidates if c.model_rank), key=lambda c: c.model_rank)
    return figure, (ranked[0].spec if ranked else None)


def stepped_tiles(spec) -> list[int]:
    """The tile sizes that cut the step-through's sequence axes (decode's queries fit in one q tile)."""
    tiles = [spec.schedule.tile_kv] + ([] if spec.problem.queries_per_seq else [spec.schedule.tile_q])
    return tiles + ([spec.backward.tile_q, spec.backward.tile_kv] if spec.backward is not None else [])


def step_seqlen(specs, override: int | None) -> int:
    """The page's step-through shape: --html-seqlen, else trace.small_seqlen of the stepped kernels' tiles."""
    if override:
        return override
    return small_seqlen([t for spec in specs for t in stepped_tiles(spec)] or [64])


def write_page(path, spec_paths, real: RealShape, seqlen: int | None = None) -> str:
    """Write the page for the spec files; returns the one line that says where it is and what it holds."""
    items = [item for p in spec_paths for item in read_items(p)]
    plan: list = []   # (figure id, a space's figure or None, the spec to step through or None, its space's name)
    for index, item in enumerate(items):
        if isinstance(item, SpecSpace):
            figure, pick = space_figure_and_pick(f"f{index}", item, real)
            plan.append((f"f{index}", figure, pick, item.name))
        else:
            plan.append((f"f{index}", None, item, ""))
    stepped = [spec for _, _, spec, _ in plan if spec is not None]
    n = step_seqlen(stepped, seqlen)
    smallest = min((t for spec in stepped for t in stepped_tiles(spec)), default=n)
    if -(-n // smallest) > MAX_TILES_PER_AXIS:
        raise CliError(f"--html-seqlen {n}: {-(-n // smallest)} tiles of {smallest} per axis; the page steps through "
                       f"at most {MAX_TILES_PER_AXIS}")
    figures, refused = [], []
    for fid, figure, spec, space in plan:
        if figure is not None:
            figures.append(figure)
        if spec is None:
            continue
        try:
            figures += kernel_figures(fid + ("p" if space else ""), spec, n, real, pick_of=space)
        except SpecError as err:   # explain prints the error; the page leaves that kernel out
            refused.append(f"{spec.name}: {err.message}")
    steps = sum(f["count"] for f in figures)
    if steps > MAX_STEPS:
        raise CliError(f"--html: {steps} steps at seqlen {n}; use a smaller --html-seqlen (fewer tiles per axis)")
    title = " + ".join(dict.fromkeys(item.name for item in items))
    text = environment().get_template("explain_page.html.j2").render(title=title, figures=figures, refused=refused,
                                                                      seqlen=n)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as err:
        raise CliError(f"--html {path}: cannot write it ({err.strerror or err})") from None
    kernels = sum(f["kind"] == "kernel" for f in figures)
    return (f"step-through page: {path} ({kernels} kernel(s), {steps} steps at seqlen {n}; open it in a browser, "
            "arrow keys step)")
