"""Every kernel tiledsl can emit, rendered to a folder: the bundled specs (search spaces expanded,
backward modules included) and every kernel the Python API picks (tuned table, fa2 picks for every
head dim, decode, paged decode and chunked prefill, FP8 KV decode, varlen (FP8 varlen too), the backward, and
softcap / ALiBi / sinks in the forward, decode, paged decode, varlen and backward kernels, documents in the backward;
block-sparse forward and backward kernels; score_mod / mask_mod examples in the forward, varlen, paged decode and
backward; dropout forward and backward). A refactor that should
change no kernel is checked by rendering before and after and comparing:
identical sources compile to identical cubins; for sources that differ, both are compiled with
nvcc (-cubin, sm_90a, the same file name) and the cubins compared byte for byte.

Sources that differ only in comments compile to the same cubin (no -G / -lineinfo): they are counted
apart and not compiled. `--sample N` compiles at most N differing kernels per template family (the
bundled specs' kernels always), for a refactor that touches thousands of sources.

Usage (no GPU):
    python bench/kernel_inventory.py render DIR                     # DIR/<kernel>.cu and DIR/manifest.json
    python bench/kernel_inventory.py compare OLD NEW [--sample N]   # exit 1 when a cubin differs or a kernel is missing
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The tree this script sits in, not whichever tiledsl an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARCH = "sm_90a"


def api_specs():
    """(what, KernelSpec) of every kernel the Python API can pick on sm_90a (forward)."""
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.dispatch.autoschedule import DECODE_HEAD_DIMS, pick_decode, supported_head_dims
    from tiledsl.serving.paged import paged_spec
    from tiledsl.serving.prefill import prefill_spec
    from tiledsl.serving.varlen import fp8_varlen_spec, varlen_spec
    from tiledsl.spec import Descale, DType, KvScale, Mask, Problem
    from tiledsl.errors import RuntimeInputError
    masks = ((Mask.NONE, None), (Mask.CAUSAL, None), (Mask.WINDOW, (128, 0)), (Mask.WINDOW, (64, 32)))
    for dtype in (DType.BF16, DType.FP16):
        for d in supported_head_dims(dtype):
            for mask, window in masks:
                yield "prefill", tuned_spec(ARCH, dtype, d, mask, d, window)[0]
                yield "prefill long", tuned_spec(ARCH, dtype, d, mask, d, window, long_kv=True)[0]
        yield "prefill dv", tuned_spec(ARCH, dtype, 128, Mask.NONE, 64)[0]
        yield "prefill scale", tuned_spec(ARCH, dtype, 128, Mask.CAUSAL, None, None, 0.1)[0]
        for d in DECODE_HEAD_DIMS:
            for q_len in (1, 2, 4, 16):
                for mask, window in masks[:3]:
                    yield "decode", tuned_spec(ARCH, dtype, d, mask, d, window, None, q_len)[0]
        for d in (64, 128, 256):
            for mask, window in masks[:3]:
                for page in (1, 16, 64, 256):
                    for q_len in (1, 4):
                        yield "paged decode", paged_spec(dtype, d, d, mask, page, q_len, window)
                    yield "paged prefill", prefill_spec(ARCH, dtype, d, d, mask, page, window)
                spec = varlen_spec(ARCH, dtype, d, mask, d, window)
                if spec is not None:
                    yield "varlen", spec
                if dtype is DType.BF16:   # FP8 varlen: O in bf16 or fp16 (the output dtype loop)
                    for out_dtype in (DType.BF16, DType.FP16):
                        for descale in (Descale.PER_TENSOR, Descale.PER_HEAD):
                            yield "fp8 varlen", fp8_varlen_spec(ARCH, d, mask, window, None, descale, out_dtype)
        for d in (64, 128, 192, 256):
            for granularity in (KvScale.PER_HEAD, KvScale.PER_TENSOR):
                for page in (None, 16):
                    for q_len in (1, 8):
                        problem = Problem(d, d, dtype, Mask.CAUSAL, kv_page_size=page, kv_dtype=DType.E4M3,
                                          kv_scale=granularity)
                        spec = pick_decode(problem, q_len)
                        if spec is not None:
                            yield "fp8 decode", spec
        try:
            yield "prefill d40", tuned_spec(ARCH, dtype, 40, Mask.NONE, 40)[0]
        except RuntimeInputError:
            pass


def backward_specs():
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.errors import RuntimeInputError
    from tiledsl.spec import DType, Mask
    for dtype in (DType.BF16, DType.FP16):
        for d in range(16, 257, 16):
            for mask, window in ((Mask.NONE, None), (Mask.CAUSAL, None), (Mask.WINDOW, (128, 0))):
                for deterministic in (False, True):
                    for mma in (None, "mma.sync"):
                        try:
                            yield "backward", chosen_backward_spec(ARCH, dtype, d, mask, d, window, None,
                                                                   deterministic, mma)
                        except RuntimeInputError:
                            pass


def modified_specs():
    """(what, KernelSpec) of the kernels with softcap, ALiBi and sinks the API picks: the hopper forward, decode
    (contiguous and paged), varlen and the warp-specialized backward, none and causal; then block_sparse_specs."""
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.modified import modifications
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.serving.paged import paged_spec
    from tiledsl.serving.varlen import varlen_spec
    from tiledsl.spec import DType, Mask
    sets = [dict(softcap=30.0), dict(alibi_slopes="geometric"), dict(sinks=True), dict(softcap=30.0, sinks=True),
            dict(softcap=30.0, alibi_slopes="geometric", sinks=True)]
    for keywords in sets:
        mods, _ = modifications("inventory", **{k: (object() if v is True else v) for k, v in keywords.items()})
        for mask in (Mask.NONE, Mask.CAUSAL):
            for d in (64, 128, 256):
                yield "modified prefill", tuned_spec(ARCH, DType.BF16, d, mask, d, None, None, 4096, mods)[0]
                yield "modified varlen", varlen_spec(ARCH, DType.BF16, d, mask, d, None, None, mods)
                yield "modified backward", chosen_backward_spec(ARCH, DType.BF16, d, mask, d, mods=mods)
            for d in (64, 128):
                for q_len in (1, 4):
                    yield "modified decode", tuned_spec(ARCH, DType.BF16, d, mask, d, None, None, q_len, mods)[0]
                    yield "modified paged decode", paged_spec(DType.BF16, d, d, mask, 16, q_len, mods=mods)
    # score_mod / mask_mod (the hopper forward only): a bias table, softcap written out, a window with a global
    # token, prefix-LM, a document mask over an aux id tensor
    expressions = [dict(score_mod="score + bias[h, q_idx - kv_idx + 4095]"),
                   dict(score_mod="50.0 * tanh(score / 50.0)"), dict(mask_mod="kv_idx == 0 | q_idx - kv_idx < 256"),
                   dict(mask_mod="kv_idx <= q_idx | kv_idx < 512"),
                   dict(mask_mod="doc[b, q_idx] == doc[b, kv_idx]")]
    for keywords in expressions:
        mods, _ = modifications("inventory", **keywords)
        for mask in (Mask.NONE, Mask.CAUSAL):
            for d in (64, 128):
                yield "expression prefill", tuned_spec(ARCH, DType.BF16, d, mask, d, None, None, 4096, mods)[0]
                yield "expression varlen", varlen_spec(ARCH, DType.BF16, d, mask, d, None, None, mods)
                for q_len in (1, 4):
                    yield "expression paged decode", paged_spec(DType.BF16, d, d, mask, 16, q_len, mods=mods)
            for d in (64, 128, 256):
                for deterministic in (False, True):
                    yield "expression backward", chosen_backward_spec(ARCH, DType.BF16, d, mask, d,
                                                                      deterministic=deterministic, mods=mods)
    # dropout (the hopper forward and the warp-specialized backward)
    mods, _ = modifications("inventory", dropout_p=0.1)
    for mask in (Mask.NONE, Mask.CAUSAL):
        for d in (64, 128, 256):
            yield "dropout prefill", tuned_spec(ARCH, DType.BF16, d, mask, d, None, None, 4096, mods)[0]
            for deterministic in (False, True):
                yield "dropout backward", chosen_backward_spec(ARCH, DType.BF16, d, mask, d,
                                                               deterministic=deterministic, mods=mods)
    # documents in the warp-specialized backward (ids and bounds; alone, with softcap and sinks), deterministic too
    for keywords in (dict(document_ids=True), dict(document_bounds=True), dict(document_ids=True, softcap=30.0,
                                                                                sinks=True)):
        mods, _ = modifications("inventory", **{k: (object() if v is True else v) for k, v in keywords.items()})
        for mask in (Mask.NONE, Mask.CAUSAL):
            for d in (64, 128, 256):
                for deterministic in (False, True):
                    yield "document backward", chosen_backward_spec(ARCH, DType.BF16, d, mask, d,
                                                                    deterministic=deterministic, mods=mods)
    yield from block_sparse_specs()


def block_sparse_specs():
    """(what, KernelSpec) of the block-sparse kernels the API picks (128 x 128 blocks, FlexAttention's default):
    the hopper forward and the warp-specialized backward (and its deterministic one), none and causal."""
    from tiledsl.dispatch.backward import chosen_backward_spec
    from tiledsl.dispatch.tuned import tuned_spec
    from tiledsl.mods.model import Modifications
    from tiledsl.spec import DType, Mask
    mods = Modifications(blocks=(128, 128))
    for mask in (Mask.NONE, Mask.CAUSAL):
        for d in (64, 128, 256):
            yield "block-sparse prefill", tuned_spec(ARCH, DType.BF16, d, mask, d, None, None, 4096, mods)[0]
            for deterministic in (False, True):
                yield "block-sparse backward", chosen_backward_spec(ARCH, DType.BF16, d, mask, d,
                                                                    deterministic=deterministic, mods=mods)


def bundled_specs():
    from tiledsl.cli.common import concrete_specs
    paths = sorted(str(p) for p in Path("specs").glob("*.tile"))
    return [("bundled", spec) for spec in concrete_specs(paths, expand_spaces=True, notes=[])]


def sources():
    """{kernel name: CUDA source} of every kernel above (forward and backward modules)."""
    from tiledsl.families import lower
    from tiledsl.codegen.render import render
    from tiledsl.lower.backward import backward_kernel_name, lower_backward
    from tiledsl.layout.backward import backward_has_template
    out: dict[str, str] = {}
    forward = list(bundled_specs()) + list(api_specs()) + [(what, spec) for what, spec in modified_specs()
                                                            if spec.backward is None]
    for _, spec in forward:
        if spec.kernel_name not in out:
            out[spec.kernel_name] = render(lower(spec))
        if spec.backward is not None and not backward_has_template(spec):
            out.setdefault(backward_kernel_name(spec), render(lower_backward(spec)))
    modified_backward = [(what, spec) for what, spec in modified_specs() if spec.backward is not None]
    for _, spec in list(backward_specs()) + modified_backward:
        name = backward_kernel_name(spec)
        if name not in out:
            out[name] = render(lower_backward(spec))
    return out


def render_all(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, text in sorted(sources().items()):
        (folder / f"{name}.cu").write_text(text)
        manifest[name] = hashlib.sha256(text.encode()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    print(f"{len(manifest)} kernels rendered into {folder}")


def cubin(source: Path, tmp: Path, tag: str) -> bytes:
    """nvcc's cubin of `source`, compiled under the same file name whichever tree it came from."""
    work = tmp / tag
    work.mkdir(parents=True, exist_ok=True)
    cu = work / source.name
    cu.write_text(source.read_text())
    out = work / (source.stem + ".cubin")
    subprocess.run(["nvcc", f"-gencode=arch=compute_{ARCH[3:]},code={ARCH}", "--cubin", "-o", str(out), str(cu)],
                   check=True, capture_output=True, cwd=work)
    return out.read_bytes()


COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def without_comments(text: str) -> str:
    return "\n".join(line.rstrip() for line in COMMENT.sub("", text).splitlines() if line.strip())


def sampled(names: list[str], per_family: int | None, bundled: set[str]) -> list[str]:
    """All of `names` (per_family None), else the bundled ones and at most per_family of each family prefix."""
    if per_family is None:
        return names
    taken: dict[str, int] = {}
    out = []
    for name in names:
        family = name.split("_")[0] + ("_bwd" if "_bwd_" in name or name.startswith("backward") else "")
        if name in bundled or taken.get(family, 0) < per_family:
            out.append(name)
            taken[family] = taken.get(family, 0) + 1
    return out


def compare(old: Path, new: Path, per_family: int | None = None) -> int:
    a = json.loads((old / "manifest.json").read_text())
    b = json.loads((new / "manifest.json").read_text())
    missing, added = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    differ = sorted(name for name in set(a) & set(b) if a[name] != b[name])
    comments = [n for n in differ if without_comments((old / f"{n}.cu").read_text())
                == without_comments((new / f"{n}.cu").read_text())]
    changed = [n for n in differ if n not in set(comments)]
    bundled = {p.stem for p in Path("generated").glob("*.cu")}
    compiled = sampled(changed, per_family, bundled)
    print(f"{len(a)} kernels before, {len(b)} after; {len(set(a) & set(b)) - len(differ)} sources identical, "
          f"{len(comments)} differ in comments only, {len(changed)} differ in code ({len(compiled)} compiled), "
          f"{len(missing)} missing, {len(added)} new")
    for name in missing:
        print(f"  missing: {name}")
    for name in added:
        print(f"  new: {name}")
    different = []

    def check(name):
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            return name, cubin(old / f"{name}.cu", t, "old") == cubin(new / f"{name}.cu", t, "new")

    with ThreadPoolExecutor(max_workers=4) as pool:
        for name, same in pool.map(check, compiled):
            print(f"  {'cubin identical' if same else 'CUBIN DIFFERS'}: {name}")
            if not same:
                different.append(name)
    return 1 if different or missing else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "render":
        render_all(Path(argv[1]))
        return 0
    if len(argv) in (3, 5) and argv[0] == "compare":
        per_family = int(argv[4]) if len(argv) == 5 and argv[3] == "--sample" else None
        return compare(Path(argv[1]), Path(argv[2]), per_family)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
