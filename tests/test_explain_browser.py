"""The `explain --html` page in a real browser (headless Chromium, tests/browser_support.py): for FA1, FA2, hopper,
decode and a backward spec it loads without a script error, steps to the end by key presses (the counters then
read explain's traffic model), and a screenshot at a middle step matches the layout: a drawn SVG with every shape
inside it, HBM above the block's places, the counters' text of that step, and pixels that are not all background.
Skipped with the reason only where Chromium is not installed and cannot be."""
from __future__ import annotations

import json

import pytest

from tiledsl.cli.main import main
from tiledsl.frontend.parse import load_specs

from .browser_support import Browser, find_chromium, install_chromium, png_pixels
from .conftest import SPEC_FILES

SPECS = ("fa1_d64", "fa2_d64", "hopper_d128_causal", "decode_d128", "backward_d64")


@pytest.fixture(scope="module")
def browser():
    binary = find_chromium()
    if binary is None:
        why = install_chromium()
        binary = find_chromium()
        if binary is None:
            pytest.skip(f"no Chromium (Debian: apt-get install -y chromium): {why}")
    with Browser(binary) as b:
        yield b


def figure_ids(browser) -> list[str]:
    return browser.evaluate("[...document.querySelectorAll('section.figure[data-kind=kernel]')].map(s => s.id)")


def text_of(browser, selector: str) -> str:
    return browser.evaluate(f"document.querySelector({json.dumps(selector)}).textContent")


@pytest.mark.parametrize("stem", SPECS)
def test_page_steps_to_the_end_by_keys_and_a_middle_step_is_laid_out(browser, tmp_path, stem):
    path = next(p for p in SPEC_FILES if p.stem == stem)
    page = tmp_path / f"{stem}.html"
    assert main(["explain", str(path), "--html", str(page)]) == 0
    browser.open(page)
    figures = figure_ids(browser)
    backward = load_specs(path)[0].backward is not None
    assert len(figures) == len(load_specs(path)) * (2 if backward else 1)
    for fid in figures:
        browser.evaluate(f"document.querySelector('nav button[data-figure=\"{fid}\"]').click()")
        data = json.loads(text_of(browser, f"#{fid} script.data"))
        steps = data["steps"]
        model = {key: int(browser.evaluate(f"document.getElementById('{fid}').dataset.{key}"))
                 for key in ("read", "written")}
        for _ in range(len(steps) - 1):
            browser.press("ArrowRight", 39)
        assert text_of(browser, f"#{fid} .pos") == f"step {len(steps)} / {len(steps)}"
        assert text_of(browser, f"#{fid}-fetched") == f"fetched from HBM: {model['read']:,} B"
        assert text_of(browser, f"#{fid}-stored") == f"stored to HBM: {model['written']:,} B"
        browser.press("ArrowRight", 39)   # past the end stays at the end
        assert text_of(browser, f"#{fid} .pos") == f"step {len(steps)} / {len(steps)}"

        browser.press("Home", 36)
        middle = len(steps) // 2
        for _ in range(middle):
            browser.press("ArrowRight", 39)
        assert text_of(browser, f"#{fid} .pos") == f"step {middle + 1} / {len(steps)}"
        expected = {eid: value for step in steps[: middle + 1] for eid, value in step["set"].items()}
        assert text_of(browser, f"#{fid}-fetched") == expected[f"{fid}-fetched"][1]
        assert text_of(browser, f"#{fid}-stored") == expected[f"{fid}-stored"][1]
        assert text_of(browser, f"#{fid} li.now").startswith(f"{middle}. ")
        check_layout(browser, fid)
    assert browser.console_errors() == []


def check_layout(browser, fid: str) -> None:
    """The visible figure's SVG: drawn, every rect inside it, HBM tiles above the block's places; the screenshot's
    pixels inside the SVG are not all one colour."""
    box = browser.evaluate(f"""(() => {{
        const svg = document.querySelector('#{fid} svg'), r = svg.getBoundingClientRect();
        const drawn = [...svg.querySelectorAll('rect, text')].filter(e => e.closest('.kgroup.off') === null
            && e.closest('g.arrows') === null && e.closest('clipPath') === null && e.closest('[clip-path]') === null);
        const inside = drawn.map(e => e.getBoundingClientRect()).filter(b => b.width > 0).every(b =>
            b.left >= r.left - 1 && b.right <= r.right + 1 && b.top >= r.top - 1 && b.bottom <= r.bottom + 1);
        const tile = svg.querySelector('rect.tile').getBoundingClientRect();
        const place = [...svg.querySelectorAll('.kgroup:not(.off) rect.place')][0].getBoundingClientRect();
        return {{left: r.left, top: r.top, width: r.width, height: r.height, inside,
                 tile: tile.bottom, place: place.top, shapes: svg.querySelectorAll('rect, text').length}};
    }})()""")
    assert box["width"] > 800 and box["height"] > 300 and box["shapes"] > 50
    assert box["inside"], "a shape lies outside the figure's SVG"
    assert box["tile"] < box["place"], "HBM tiles are not drawn above the block's on-chip places"
    width, height, rows = png_pixels(browser.screenshot())
    channels = len(rows[0]) // width
    top, bottom = int(box["top"]) + 2, min(int(box["top"] + box["height"]) - 2, height)
    left, right = int(box["left"]) + 2, min(int(box["left"] + box["width"]) - 2, width)
    colours = {rows[y][x * channels:x * channels + 3] for y in range(top, bottom, 7) for x in range(left, right, 7)}
    assert len(colours) > 20, f"the SVG area of the screenshot has {len(colours)} colours: blank?"
