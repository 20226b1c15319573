"""What `tiledsl explain` says of FP8 attention (dtype = e4m3): the descales' granularity, shapes and where they
enter the arithmetic, P scaled and rounded to e4m3 before P V, V's transpose on chip, and the HBM bytes per tensor
beside the same accesses on bf16 inputs. Lines for the report and a dict for --json, each number read where the
kernel's own comes from: the layout (V^T's ring), the lowering (P's scale), the runtime (the descales' shapes), the
traffic model (elements per tensor) and its element sizes."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..layout.hopper import FP8_TRANSPOSERS, fp8_swizzle
from ..schedule.traffic import Traffic, element_bytes, elements_by_tensor
from ..spec import Descale, DType, KernelSpec, Problem, SeqLayout


@dataclass(frozen=True)
class Quantization:
    descale: Descale
    granularity: str                               # what one descale covers
    folded: str                                    # where the descales enter the kernel's arithmetic
    shapes: tuple[tuple[str, tuple[int, ...]], ...]   # (q_descale, shape), ... for the explained launch
    p_scale: float                                 # P's factor before its e4m3 conversion
    transposer_warps: int                          # the producer's warps 1.. that write V^T
    transposers: int                               # their threads
    vt_stage_bytes: int
    vt_stages: int
    vt_swizzle: int                                # bytes of one swizzled V^T row
    out_dtype: DType


def quantization(spec: KernelSpec, layout, batch: int, heads: int, kv_heads: int, seqlen_q: int,
                 seqlen_kv: int) -> Quantization | None:
    """The FP8 facts of `spec` for one launch shape (batch: the sequences of a varlen launch); None for 16-bit."""
    p, s = spec.problem, spec.schedule
    if not p.fp8:
        return None
    from ..hw import WARP_THREADS
    from ..lower.hopper import FP8_P_SCALE
    from ..runtime.fp8_descales import FP8_DESCALES, descale_shapes
    from ..runtime.inputs import Shapes
    rows = "sequence" if p.seq_layout is SeqLayout.VARLEN else "batch"
    granularity, folded = {
        Descale.PER_TENSOR: ("one per tensor", "q x k scales S before the softmax, v scales O at the end"),
        Descale.PER_HEAD: (f"one per ({rows}, kv head), Q's shared by the kv head's query heads",
                           "q x k scales S before the softmax, v scales O at the end"),
        Descale.PER_BLOCK: (f"one per Q tile of {s.tile_q} rows of a ({rows}, head) and per K / V tile of {s.tile_kv} "
                            f"keys of a ({rows}, kv head)",
                            "Q's x the K tile's scale S per tile; V's tile ratio rides on O's rescale, the last "
                            "tile's scales O at the end")}[p.descales]
    shapes = descale_shapes(p.descales, Shapes(batch, heads, kv_heads, seqlen_q, seqlen_kv), s.tile_q, s.tile_kv)
    vt = layout.buffer("V^T")
    return Quantization(p.descales, granularity, folded, tuple(zip(FP8_DESCALES, shapes)), FP8_P_SCALE,
                        FP8_TRANSPOSERS, FP8_TRANSPOSERS * WARP_THREADS, vt.stage_bytes, vt.stages,
                        fp8_swizzle(s.tile_kv), p.output_dtype)


def bf16_problem(problem: Problem) -> Problem:
    """The same problem on bf16 inputs and output: the accesses an FP8 kernel's traffic is compared with."""
    return dataclasses.replace(problem, dtype=DType.BF16, out_dtype=None, descale=None)


def tensor_rows(t: Traffic, problem: Problem) -> list[dict]:
    """Per (tensor, mode): elements, bytes per element and bytes; with FP8 inputs also the bytes at bf16."""
    twin = bf16_problem(problem) if problem.fp8 else None
    rows = []
    for (tensor, mode), elements in elements_by_tensor(t).items():
        size = element_bytes(tensor, problem)
        row = {"tensor": tensor, "mode": mode, "elements": elements, "element_bytes": size, "bytes": elements * size}
        if twin is not None:
            row["bf16_bytes"] = elements * element_bytes(tensor, twin)
        rows.append(row)
    return rows


def quantization_lines(q: Quantization, rows: list[dict], human) -> list[str]:
    """The report's FP8 section: descales, P, V^T, then the bytes per tensor beside bf16's."""
    shapes = ", ".join(f"{name} {shape}" for name, shape in q.shapes)
    lines = ["", "FP8 (e4m3) quantization:",
             f"    inputs: Q, K, V e4m3 (1 byte per element), value = byte x descale; O {q.out_dtype.value}",
             f"    descales ({q.descale.value}): {q.granularity}; float32 {shapes}",
             f"        {q.folded}",
             f"    P: scaled by {q.p_scale:g} into e4m3's range and rounded to e4m3 (nearest, saturating) before "
             "P V; l sums P unrounded; O divides the scale out",
             f"    V: transposed on chip: {q.transposers} producer threads (warps 1..{q.transposer_warps}) write each "
             f"V tile as V^T (dv rows of Bc key bytes, {q.vt_swizzle} B swizzle; {q.vt_stages} x "
             f"{q.vt_stage_bytes} B), K-major as e4m3 wgmma reads its B operand; P V waits for V^T's barrier",
             "    HBM bytes per tensor, this kernel and the same accesses on bf16 inputs:"]
    for r in rows:
        lines.append(f"        {r['mode']:<5} {r['tensor']:<9} {human(r['bytes']):>12} ({r['element_bytes']} B each)   "
                     f"bf16 {human(r['bf16_bytes']):>12}")
    total, total_bf16 = sum(r["bytes"] for r in rows), sum(r["bf16_bytes"] for r in rows)
    lines.append(f"        {'total':<15} {human(total):>12}              bf16 {human(total_bf16):>12}   "
                 f"({total / max(total_bf16, 1):.2f} of bf16's)")
    return lines


def summary_line(q: Quantization, rows: list[dict], human) -> str:
    total, total_bf16 = sum(r["bytes"] for r in rows), sum(r["bf16_bytes"] for r in rows)
    return (f"FP8: descales {q.descale.value}; P x {q.p_scale:g} rounded to e4m3 before P V; V transposed on chip; "
            f"HBM {human(total)} ({human(total_bf16)} on bf16 inputs)")


def quantization_dict(q: Quantization) -> dict:
    return {"descale": q.descale.value, "granularity": q.granularity, "folded": q.folded,
            "descale_shapes": {name: list(shape) for name, shape in q.shapes}, "descale_dtype": "fp32",
            "input_dtype": "e4m3", "out_dtype": q.out_dtype.value, "p_scale": q.p_scale, "p_rounded_to": "e4m3",
            "v_transpose": {"warps": q.transposer_warps, "threads": q.transposers, "stage_bytes": q.vt_stage_bytes,
                            "stages": q.vt_stages, "swizzle_bytes": q.vt_swizzle}}
