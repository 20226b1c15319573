"""Float64 reference for an FP8 (e4m3) KV cache: decode the stored bytes, scale, then attend with
serving_reference (paged) or per sequence (contiguous).

e4m3 (OCP "E4M3FN", torch.float8_e4m3fn): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits.
Exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN; there are no infinities, so the
largest value is 1.1110.110 = 448. NumPy has no e4m3: the bits are decoded here, from the same
bytes the kernel reads (torch tensors through .view(torch.uint8)).
"""
from __future__ import annotations

import numpy as np

from .serving import attend, paged_attention as _paged


def e4m3_values() -> np.ndarray:
    """The float64 value of each of the 256 e4m3 bytes."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0 ** -6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values


_TABLE = e4m3_values()


def decode_e4m3(raw) -> np.ndarray:
    """float64 values of an array of e4m3 bytes (uint8)."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"decode_e4m3 takes the bytes as uint8, got {raw.dtype}")
    return _TABLE[raw]


def dequantize(raw, scale, head_axis: int) -> np.ndarray:
    """decode_e4m3(raw) * scale, scale a float (per tensor) or one value per kv head along head_axis."""
    values = decode_e4m3(raw)
    scale = np.asarray(scale, dtype=np.float64).reshape(-1)
    if scale.size == 1:
        return values * scale[0]
    shape = [1] * values.ndim
    shape[head_axis] = scale.size
    return values * scale.reshape(shape)


def paged_attention_fp8(q, k_bytes, v_bytes, k_scale, v_scale, block_table, kv_lens, **mask):
    """serving_reference.paged_attention over caches (pages, page size, kv heads, d) of e4m3 bytes."""
    return _paged(q, dequantize(k_bytes, k_scale, 2), dequantize(v_bytes, v_scale, 2), block_table, kv_lens, **mask)


def attention_fp8(q, k_bytes, v_bytes, k_scale, v_scale, kv_lens=None, **mask):
    """Contiguous decode layout: q (batch, heads, nq, d), k/v bytes (batch, kv heads, n, d) ->
    (o (batch, heads, nq, dv), lse (batch, heads, nq)), sequence b using its first kv_lens[b] keys."""
    q = np.asarray(q, dtype=np.float64)
    k, v = dequantize(k_bytes, k_scale, 1), dequantize(v_bytes, v_scale, 1)
    batch, heads, nq, _ = q.shape
    o, lse = np.zeros((batch, heads, nq, v.shape[3])), np.full((batch, heads, nq), -np.inf)
    for b in range(batch):
        n = k.shape[2] if kv_lens is None else int(np.asarray(kv_lens)[b])
        ob, lb = attend(q[b].transpose(1, 0, 2), k[b, :, :n].transpose(1, 0, 2), v[b, :, :n].transpose(1, 0, 2), **mask)
        o[b], lse[b] = ob.transpose(1, 0, 2), lb.T
    return o, lse


def dequantize_blocks(raw, descale, block: int) -> np.ndarray:
    """decode_e4m3(raw) * descale for raw (batch, heads, seqlen, d) and one descale per block of `block` rows
    of a (batch, head): descale (batch, heads, ceil(seqlen / block))."""
    values = decode_e4m3(raw)
    descale = np.asarray(descale, dtype=np.float64)
    rows = np.arange(values.shape[2]) // block
    return values * descale[:, :, rows][..., None]


def dequantize_descaled(raw, descale, block: int | None = None) -> np.ndarray:
    """FP8 attention's dequantized input (batch, heads, seqlen, d) in float64: `descale` a float or one-element
    array (per tensor), (batch, heads) (per head: FlashAttention-3's convention, Q's indexed by kv head and
    broadcast here by the caller), or with `block` one per block of rows (dequantize_blocks)."""
    if block is not None:
        return dequantize_blocks(raw, descale, block)
    values = decode_e4m3(raw)
    descale = np.asarray(descale, dtype=np.float64)
    if descale.size == 1:
        return values * descale.reshape(-1)[0]
    return values * descale[:, :, None, None]


def dequantize_fp8_inputs(q_bytes, k_bytes, v_bytes, q_descale, k_descale, v_descale, block_q: int | None = None,
                          block_kv: int | None = None):
    """(q, k, v) in float64 from FP8 prefill inputs (batch, heads, seqlen, d) of e4m3 bytes, dequantized as the
    kernel reads them: per tensor, per (batch, kv head) (q_descale too, shared by the kv head's query heads), or per
    block (block_q rows of a query head, block_kv keys of a kv head)."""
    heads, kv_heads = np.asarray(q_bytes).shape[1], np.asarray(k_bytes).shape[1]
    q_descale = np.asarray(q_descale, dtype=np.float64)
    if block_q is None and q_descale.ndim == 2 and q_descale.size > 1:   # (batch, kv heads) -> (batch, heads)
        q_descale = np.repeat(q_descale, heads // kv_heads, axis=1)
    return (dequantize_descaled(q_bytes, q_descale, block_q), dequantize_descaled(k_bytes, k_descale, block_kv),
            dequantize_descaled(v_bytes, v_descale, block_kv))


def prefill_attention_fp8(q_bytes, k_bytes, v_bytes, q_descale, k_descale, v_descale, *, block_q: int | None = None,
                          block_kv: int | None = None, kv_lens=None, mask="none", window_left: int = 0,
                          window_right: int = 0, scale: float | None = None):
    """Float64 attention of FP8 prefill inputs (dequantize_fp8_inputs): exact softmax, P unrounded. (o, lse) as
    naive_attention's."""
    from .forward import naive_attention
    q, k, v = dequantize_fp8_inputs(q_bytes, k_bytes, v_bytes, q_descale, k_descale, v_descale, block_q, block_kv)
    return naive_attention(q, k, v, mask, window_left, window_right, scale, kv_lens)


def round_p_e4m3(p, p_scale: float | None = None) -> np.ndarray:
    """The weights the FP8 kernel's P V reads: e4m3(P * P_SCALE) / P_SCALE, P relative to the running max (<= 1),
    rounded as cvt.rn.satfinite rounds (encode_e4m3)."""
    from ..lower.hopper import FP8_P_SCALE
    p_scale = FP8_P_SCALE if p_scale is None else p_scale
    return decode_e4m3(encode_e4m3(np.asarray(p) * p_scale)) / p_scale


def fp8_kernel_attention(spec, q_bytes, k_bytes, v_bytes, q_descale, k_descale, v_descale, kv_lens=None,
                         round_p: bool = True):
    """The FP8 kernel's arithmetic in float64, for `spec` (its mask, scale and kv tile; per-block descales of its
    tiles): the online softmax over kv tiles of tile_kv keys, each tile's P = exp(s - m) against the running max m
    after it, rounded to e4m3 (round_p_e4m3) for P V while l sums it unrounded, O and l carried to the final max
    by exp(m_tile - m_final) (the product of the tiles' rescales). What it leaves out is the GPU's fp32 (the tensor
    cores' accumulation, ex2.approx) and the output's rounding. round_p=False: prefill_attention_fp8's numbers up
    to summation order. The tiles are evaluated at once (one Q K^T and one P V per chunk of rows). (o, lse)."""
    from ..schedule.masks import key_bounds
    from ..spec import Descale
    from .forward import CHUNK_ELEMENTS, check_inputs
    problem, tile = spec.problem, spec.schedule.tile_kv
    blocks = (spec.schedule.tile_q, tile) if problem.descales is Descale.PER_BLOCK else (None, None)
    q, k, v = dequantize_fp8_inputs(q_bytes, k_bytes, v_bytes, q_descale, k_descale, v_descale, *blocks)
    q, k, v, lens = check_inputs(q, k, v, kv_lens)
    batch, heads, nq, _ = q.shape
    group = heads // k.shape[1]
    o, lse = np.zeros((batch, heads, nq, v.shape[3])), np.full((batch, heads, nq), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        tiles = -(-n // tile)
        chunk = max(1, CHUNK_ELEMENTS // (tiles * tile))
        for h in range(heads):
            for r0 in range(0, nq, chunk):
                rows = np.arange(r0, min(r0 + chunk, nq))
                lo, hi = key_bounds(rows, nq, n, problem.mask, problem.window_left, problem.window_right)
                s = np.full((len(rows), tiles * tile), -np.inf)
                s[:, :n] = q[b, h, rows] @ k[b, h // group, :n].T * problem.scale
                keys = np.arange(tiles * tile)
                s[(keys < lo[:, None]) | (keys >= hi[:, None])] = -np.inf
                s = s.reshape(len(rows), tiles, tile)
                running = np.maximum.accumulate(s.max(axis=2), axis=1)   # m after each tile
                final = running[:, -1]
                seen = np.isfinite(final)
                final = np.where(seen, final, 0.0)
                running = np.where(np.isfinite(running), running, final[:, None])   # no key yet: carried by 1
                p = np.exp(s - running[..., None])
                carry = np.exp(running - final[:, None])[..., None]
                l = (p * carry).sum(axis=(1, 2))
                weights = (round_p_e4m3(p) if round_p else p) * carry
                pv = weights.reshape(len(rows), -1)[:, :n] @ v[b, h // group, :n]
                o[b, h, rows] = np.where(seen[:, None], pv / np.where(seen, l, 1.0)[:, None], 0.0)
                lse[b, h, rows] = np.where(seen, final + np.log(np.where(seen, l, 1.0)), -np.inf)
    return o, lse


def varlen_fp8_kernel_attention(spec, q_bytes, k_bytes, v_bytes, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale,
                                v_descale, round_p: bool = True):
    """fp8_kernel_attention per packed sequence (the varlen kernel's tiles start at each sequence's first key): q
    bytes (total_q, heads, d), k and v bytes (total_k, kv_heads, d), cu_seqlens (sequences + 1,); descales one value
    each (per tensor) or (sequences, kv_heads) each, sequence b reading row b. (o (total_q, heads, dv), lse (total_q,
    heads)), as reference.serving.varlen_attention returns them."""
    q_bytes, k_bytes, v_bytes = (np.asarray(x) for x in (q_bytes, k_bytes, v_bytes))
    cu_q, cu_k = np.asarray(cu_seqlens_q, dtype=np.int64), np.asarray(cu_seqlens_k, dtype=np.int64)
    descales = [np.asarray(x, dtype=np.float64) for x in (q_descale, k_descale, v_descale)]
    o = np.zeros(q_bytes.shape[:2] + (v_bytes.shape[2],))
    lse = np.full(q_bytes.shape[:2], -np.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b]:
            continue
        one = [x if x.size == 1 else x[b:b + 1] for x in descales]   # (1, kv_heads): the sequence's row
        batched = [x[None, part].transpose(0, 2, 1, 3) for x, part in ((q_bytes, rows), (k_bytes, keys),
                                                                        (v_bytes, keys))]   # (1, heads, n, d)
        ob, lb = fp8_kernel_attention(spec, *batched, *one, round_p=round_p)
        o[rows], lse[rows] = ob[0].transpose(1, 0, 2), lb[0].T
    return o, lse


# -- quantize_fp8's model (runtime/quantize_fp8.py computes the same in float32, in the same order) --------
E4M3_MAX = 448.0


def encode_e4m3(x) -> np.ndarray:
    """float32 values -> e4m3 bytes, rounded to nearest (ties to even) and saturated at +-448 (cvt.rn.satfinite)."""
    x = np.asarray(x, dtype=np.float64)
    positive = _TABLE[:0x7F]   # bytes 0x00..0x7E: 0 .. 448, increasing
    magnitude = np.minimum(np.abs(x), E4M3_MAX)
    upper = np.clip(np.searchsorted(positive, magnitude), 1, 0x7E)
    lower = upper - 1
    below, above = magnitude - positive[lower], positive[upper] - magnitude
    pick_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = np.where(magnitude >= positive[upper], upper, np.where(pick_upper, upper, lower)).astype(np.uint8)
    return np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)   # -0 and negatives under 2^-10: 0x80


def hadamard_signs(head_dim: int, seed: int) -> np.ndarray:
    """The random signs of the rotation diag(signs) H / sqrt(d) (float32 +-1), the same for Q and K."""
    return np.where(np.random.default_rng(seed).random(head_dim) < 0.5, -1.0, 1.0).astype(np.float32)


def rotate_rows(x, signs) -> np.ndarray:
    """x (..., d) @ diag(signs) H / sqrt(d) in float32, the butterflies in the kernel's order (strides 1, 2, ...,
    d/2; H the Sylvester Hadamard matrix, symmetric: the rotation's inverse is H diag(signs) / sqrt(d))."""
    y = np.asarray(x, dtype=np.float32) * signs
    d = y.shape[-1]
    h = 1
    while h < d:
        pairs = y.reshape(y.shape[:-1] + (d // (2 * h), 2, h))
        a, b = pairs[..., 0, :].copy(), pairs[..., 1, :].copy()
        pairs[..., 0, :], pairs[..., 1, :] = a + b, a - b
        y = pairs.reshape(y.shape)
        h *= 2
    return y * np.float32(1.0 / np.sqrt(d))


def quantize_model(x, block: int | None, kv_heads: int | None = None, per_tensor: bool = False):
    """(e4m3 bytes, float32 descales) of x (batch, heads, seqlen, d) float32: descale = absmax / 448, byte =
    e4m3(x * (448 / absmax)) (both factors float32, 1 where a group is all zero). Groups: per tensor, per (batch, kv
    head) over its heads (kv_heads of them; Q's heads share their kv head's), or per block of `block` rows of each
    (batch, head)."""
    x = np.asarray(x, dtype=np.float32)
    batch, heads, n, d = x.shape
    if per_tensor:
        absmax = np.abs(x).max(initial=0.0).reshape(1)
        return encode_e4m3(x * _inverse(absmax)[0]), _descale(absmax)
    if block is None:
        group = heads // (kv_heads or heads)
        absmax = np.abs(x).reshape(batch, heads // group, group * n * d).max(axis=-1, initial=0.0)
        return encode_e4m3(x * np.repeat(_inverse(absmax), group, axis=1)[:, :, None, None]), _descale(absmax)
    tiles = -(-n // block)
    padded = np.zeros((batch, heads, tiles * block, d), dtype=np.float32)
    padded[:, :, :n] = np.abs(x)
    absmax = padded.reshape(batch, heads, tiles, block * d).max(axis=-1)
    return encode_e4m3(x * np.repeat(_inverse(absmax), block, axis=2)[:, :, :n, None]), _descale(absmax)


def _descale(absmax) -> np.ndarray:
    absmax = np.asarray(absmax, dtype=np.float32)
    return np.where(absmax > 0, absmax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)


def _inverse(absmax) -> np.ndarray:
    """448 / absmax in float32 (1 for an all-zero group): what each value is multiplied by before its conversion."""
    absmax = np.asarray(absmax, dtype=np.float32)
    safe = np.where(absmax > 0, absmax, np.float32(1.0))
    return np.where(absmax > 0, np.float32(E4M3_MAX) / safe, np.float32(1.0)).astype(np.float32)
