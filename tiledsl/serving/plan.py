"""Plan once per step, run once per layer: the serving API of FlashInfer's wrappers and vLLM's backends.

    decode = tiledsl.PagedAttention(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                    num_pages=k_cache.shape[0], dtype=torch.bfloat16, device="cuda",
                                    max_batch=64, max_pages=512)
    for step in steps:
        decode.plan(block_table, kv_lens)                  # host (or pinned) int32 arrays, once per step
        for layer in layers:
            o = decode.run(q[layer], k_cache[layer], v_cache[layer], out=o_buffers[layer])

`plan` reads the block table and lengths on the host (where a scheduler keeps them), checks them
(runtime/serving_checks.check_paged: every page a sequence needs is one of the cache's `num_pages`,
no length negative or over the table), picks the kernel and its split count for the longest
sequence (or `max_kv_len`), and uploads lengths and table into the wrapper's device buffer with one
non-blocking copy from a pinned staging buffer. `run` checks only what O(1) checks can (the tensors'
shapes, strides, dtypes and devices against the plan: a dictionary lookup) and launches: no host
sync, no allocation with `out=` (the LSE goes to the wrapper's buffer unless `lse=` is given), so a
run can be captured in a CUDA graph. A captured run replays the plan it was captured under (grid,
split count, key bound): re-plan with the same batch, table width and `max_kv_len` and the replay
reads the new metadata. One wrapper serves one stream at a time (its metadata, LSE and split-KV
buffers are its own).

`VarlenAttention` does the same for packed variable-length batches: `plan(cu_seqlens_q,
cu_seqlens_k)` checks the offsets and builds the longest-first work list on the host, uploads both
and the list in one copy; `run(q, k, v, out=None)` launches the hopper varlen kernel (with softcap, ALiBi,
sinks, score_mod and mask_mod as PagedAttention takes them; varlen_attention's kernel and arguments).

Up to DECODE_MAX_QUERIES queries per sequence (`plan(..., q_len=)`) run the paged decode kernel;
more run chunked prefill (fa2 mma.sync over the paged cache).
"""
from __future__ import annotations

import numpy as np

from ..errors import RuntimeInputError
from ..mods.model import AUX_ALIBI, AUX_SINKS
from ..runtime.decode import tensor_or_none
from ..runtime.launch import SignatureCache
from ..runtime.serving_checks import check_paged, check_varlen
from ..runtime.tensors import signature
from ..spec import KV_PAGE_SIZES, DType, Mask


def _host_int32(x, name: str) -> np.ndarray:
    """A host int32 NumPy array of `x` (NumPy, a list, or a CPU / pinned torch tensor); GPU tensors
    are refused: plan reads them on the host, which would sync."""
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise RuntimeInputError(f"plan: {name} is on {x.device}; pass the host copy the scheduler keeps (a "
                                    "CPU or pinned tensor, or NumPy): reading a GPU tensor would sync")
        x = x.numpy()
    elif type(x).__module__.startswith("cupy"):
        raise RuntimeInputError(f"plan: {name} is a CuPy (GPU) array; pass the host copy (NumPy)")
    a = np.asarray(x)
    if a.dtype != np.int32:
        raise RuntimeInputError(f"plan: {name} must be int32, got {a.dtype}")
    return a


PART_ALIGN = 4   # int32 words: every part of an upload starts on a 16-byte boundary


def words_for(*sizes: int) -> int:
    """The buffer an upload of parts of these sizes needs (each rounded up to PART_ALIGN words)."""
    return sum(-(-n // PART_ALIGN) * PART_ALIGN for n in sizes)


class MetadataUpload:
    """The wrapper's int32 device buffer of `words` entries and two pinned host staging buffers: an
    upload writes one staging buffer and copies it to the device with one non-blocking copy on the
    current stream, alternating so that a plan never overwrites memory a copy in flight still reads."""

    def __init__(self, device, words: int, framework: str):
        self.framework, self.words = framework, words
        if framework == "torch":
            import torch
            self.device = torch.empty(words, dtype=torch.int32, device=device)
            self.staging = [torch.empty(words, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self.hosts = [s.numpy() for s in self.staging]
            self.events = [None, None]
        else:
            import cupy
            import cupyx
            with cupy.cuda.Device(device):
                self.device = cupy.empty(words, dtype=cupy.int32)
            self.hosts = [cupyx.empty_pinned(words, dtype=np.int32) for _ in range(2)]
            self.staging = self.hosts
            self.events = [None, None]
        self.turn = 0

    def upload(self, parts: list[np.ndarray]) -> list:
        """Copy `parts` (int32 arrays) one after another into the device buffer, each starting on a
        16-byte boundary; returns device views of each part (flat)."""
        sizes = [p.size for p in parts]
        starts = [sum(-(-n // PART_ALIGN) * PART_ALIGN for n in sizes[:i]) for i in range(len(sizes))]
        total = starts[-1] + sizes[-1] if parts else 0
        if total > self.words:
            raise RuntimeInputError(f"plan: the metadata needs {total} int32 words, the wrapper holds {self.words} "
                                    "(raise max_batch / max_pages / max_items)")
        i = self.turn
        self.turn = 1 - i
        event = self.events[i]
        if event is not None and not (event.query() if hasattr(event, "query") else event.done):
            event.synchronize()   # the copy that last read this staging buffer (two plans ago) still runs
        host = self.hosts[i]
        for part, start, n in zip(parts, starts, sizes):
            host[start:start + n] = part.ravel()
        if self.framework == "torch":
            import torch
            self.device[:total].copy_(self.staging[i][:total], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            import cupy
            self.device[:total].set(host[:total], stream=cupy.cuda.get_current_stream())
            event = cupy.cuda.Event()
            event.record()
        self.events[i] = event
        return [self.device[start:start + n] for start, n in zip(starts, sizes)]


def _framework(device) -> str:
    """"torch" for a torch device (or "cuda" strings), "cupy" for a CuPy device id."""
    if isinstance(device, int):
        return "cupy"
    return "torch"


class PagedAttention:
    """Paged-KV attention planned once per step and run once per layer (module docstring).

    num_heads / num_kv_heads / head_dim (/ head_dim_v): the model's attention; page_size and
    num_pages: the cache's (pages, page size, kv heads, d) shape; dtype: q's and the caches' (or
    kv_dtype=torch.float8_e4m3fn caches with k_scale / v_scale as in paged_attention); device: a torch
    device (or a CuPy device id); max_batch and max_pages bound what a plan may hold (the device
    buffers are sized by them once). Score modifications are part of the plan, as in paged_attention
    (decode only): `softcap` (a float), `alibi_slopes` ("geometric", or a float32 (heads,) / (batch, heads)
    tensor) and `sinks` (a float32 (heads,) tensor, or True: each run passes its layer's `sinks=`); the tensors
    are read by pointer on every run (run's `sinks=` / `alibi_slopes=` replace them for that run: one per layer).
    `score_mod` / `mask_mod` (paged_attention's: q_idx a query's position in its sequence) are fixed with the
    wrapper too, and their aux tensors given by name in `aux` or by each run's `aux=` (which replace the
    wrapper's for that run, as `sinks=` does)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *, num_pages: int,
                 dtype, device, max_batch: int, max_pages: int, head_dim_v: int | None = None, causal: bool = False,
                 window: tuple[int, int] | None = None, scale: float | None = None, kv_dtype=None, k_scale=None,
                 v_scale=None, softcap=None, alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None, aux=None):
        from ..dispatch.modified import modifications
        from ..runtime.decode import DecodeWorkspace
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise RuntimeInputError(f"PagedAttention: {num_heads} query heads are not a multiple of {num_kv_heads} "
                                    "kv heads")
        if page_size not in KV_PAGE_SIZES:
            raise RuntimeInputError(f"PagedAttention: page_size must be a power of two in 1..256, got {page_size}")
        if causal and window is not None:
            raise ValueError("PagedAttention: pass causal=True or window=(left, right), not both")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.head_dim_v = head_dim_v or head_dim
        self.page_size, self.num_pages = page_size, num_pages
        self.dtype, self.kv_dtype, self.device = dtype, kv_dtype, device
        self.max_batch, self.max_pages = max_batch, max_pages
        self.causal, self.window, self.scale = causal, None if window is None else tuple(window), scale
        self.k_scale, self.v_scale = k_scale, v_scale
        self.mods, tensors = modifications("PagedAttention", softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                           score_mod=score_mod, mask_mod=mask_mod, aux=aux)
        # the runs' aux tensors unless a run passes its own (a traced callable's captured tensors among them)
        self.aux = tensors | {AUX_ALIBI: alibi_slopes, AUX_SINKS: sinks}
        self.framework = _framework(device)
        self.metadata = MetadataUpload(device, words_for(max_batch, max_batch * max_pages), self.framework)
        self.workspace = DecodeWorkspace()
        self.lse_buffer = None
        self.planned = None   # (batch, width, q_len, kv bound, lens view, table view, (kernel, fp8))
        self._kernels: dict = {}   # q_len -> (kernel, fp8)
        self._calls = SignatureCache(64)

    def plan(self, block_table, kv_lens, *, q_len: int = 1, max_kv_len: int | None = None) -> None:
        """Check and upload this step's block table (batch, pages) and kv_lens (batch,), host int32 arrays;
        `q_len` queries per sequence; `max_kv_len` bounds the keys a launch is sized for (None: the
        longest sequence of this plan; a fixed bound keeps a captured run valid across plans)."""
        table = _host_int32(block_table, "block_table")
        lens = _host_int32(kv_lens, "kv_lens")
        if table.ndim != 2 or table.shape[0] > self.max_batch or table.shape[1] > self.max_pages:
            raise RuntimeInputError(f"plan: block_table must be (batch <= {self.max_batch}, pages <= "
                                    f"{self.max_pages}), got shape {table.shape}")
        check_paged(table, lens, self.num_pages, self.page_size)
        batch, width = table.shape
        longest = int(lens.max()) if batch else 0
        bound = longest if max_kv_len is None else int(max_kv_len)
        if bound < longest:
            raise RuntimeInputError(f"plan: max_kv_len = {bound} is under the longest kv_len {longest}")
        lens_view, table_view = self.metadata.upload([lens, table])
        table_view = table_view.reshape(batch, width) if batch else table_view.reshape(0, width)
        kernel = self._kernels.get(q_len)
        if kernel is None:
            kernel = self._kernels[q_len] = self._kernel(q_len)
        self.planned = (batch, width, q_len, bound, lens_view, table_view, kernel)
        self.plan_key = (batch, width, q_len, bound, id(kernel[0]))
        self.lse_view = self._lse(batch, q_len)

    def _kernel(self, q_len: int):
        """The kernel of a plan of `q_len` queries, picked from the wrapper's shapes and dtypes (views of
        no memory: the pick reads dtypes and sizes alone)."""
        from ..runtime.tensors import TensorView
        from .paged import paged_kernel
        dtype = _dtype(self.dtype)
        kv_dtype = _dtype(self.kv_dtype) if self.kv_dtype is not None else dtype
        qv = TensorView("q", 0, (1, q_len, self.num_heads, self.head_dim), (0, 0, 0, 1), dtype, 0, None)
        kv = TensorView("k_cache", 0, (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim),
                        (0, 0, 0, 1), kv_dtype, 0, None)
        vv = TensorView("v_cache", 0, (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim_v),
                        (0, 0, 0, 1), kv_dtype, 0, None)
        mask = Mask.WINDOW if self.window is not None else (Mask.CAUSAL if self.causal else Mask.NONE)
        return paged_kernel("PagedAttention", qv, kv, vv, mask, self.window, self.scale, self.k_scale, self.v_scale,
                            self.mods)

    def run(self, q, k_cache, v_cache, out=None, *, lse=None, return_lse: bool = False, sinks=None,
            alibi_slopes=None, aux=None):
        """O (batch, q_len, heads, dv) of the planned step for one layer's q and caches, into `out` when
        given; with `return_lse` also LSE (batch, q_len, heads) (the wrapper's buffer, valid until the
        next run, unless `lse=` (batch, heads, q_len) fp32 is given). `sinks` / `alibi_slopes` / `aux` (the
        expressions' tensors by name): this layer's, for a wrapper made with them (None: the wrapper's)."""
        if self.planned is None:
            raise RuntimeInputError("PagedAttention.run: call plan(block_table, kv_lens) first")
        batch, width, q_len, bound, lens_view, table_view, (kernel, fp8) = self.planned
        if lse is None:
            lse = self.lse_view
        key = (signature(q), signature(k_cache), signature(v_cache), signature(out), signature(lse), self.plan_key)
        aux = layer_aux("PagedAttention.run", kernel.aux_names, self.aux, aux, sinks, alibi_slopes)
        key += tuple(map(signature, aux))
        call = self._calls.get(key)
        if call is None:
            call = self._calls.put(key, self._prepare(kernel, fp8, q, k_cache, v_cache, out, lse, aux))
        tensors = (q, k_cache, v_cache, table_view, lens_view, out, lse)
        if fp8 or aux:
            tensors += (tensor_or_none(self.k_scale), tensor_or_none(self.v_scale)) + aux
        out, lse = call(*tensors)
        return (out, lse.swapaxes(1, 2)) if return_lse else out

    def _lse(self, batch: int, q_len: int):
        need = batch * self.num_heads * q_len
        if self.lse_buffer is None or self.lse_buffer.shape[0] < need:
            from ..runtime.launch import allocator
            like = self.metadata.device
            self.lse_buffer = allocator(like, (max(need, 1),), "float32")()
        return self.lse_buffer[:need].reshape(batch, self.num_heads, q_len)

    def _prepare(self, kernel, fp8, q, k_cache, v_cache, out, lse, aux=()):
        batch, width, q_len, bound, lens_view, table_view, _ = self.planned
        pages = signature(k_cache)[0][0] if signature(k_cache) else 0
        if pages < self.num_pages:
            raise RuntimeInputError(f"PagedAttention.run: k_cache holds {pages} pages, the plan was checked against "
                                    f"num_pages = {self.num_pages}")
        tensors = (q, k_cache, v_cache, table_view, lens_view, out, lse)
        options = {"validate": False, "kv_len": bound}
        if kernel.spec.family.value == "decode":
            options["workspace"] = self.workspace
        if aux:
            from ..dispatch.modified import check_launch
            refuse_missing_aux("PagedAttention.run", kernel.aux_names, aux)
            check_launch(self.mods, dict(zip(kernel.aux_names, aux)), batch, self.num_heads, q_len,
                         width * self.page_size, ragged=True, where="PagedAttention.run", positions=True)
        if fp8 or aux:
            tensors += (tensor_or_none(self.k_scale), tensor_or_none(self.v_scale)) + aux
            options.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return kernel.prepare_call(tensors, **options)


def layer_aux(where: str, names: tuple, defaults: dict, aux: dict | None, sinks, alibi_slopes) -> tuple:
    """A wrapper run's aux tensors in its kernel's order (`names`): the run's `aux` (the expressions' tensors by name),
    `sinks` and `alibi_slopes` where given, else the wrapper's `defaults`. A tensor the kernel does not read is
    refused by name (`where`: the run), not ignored."""
    layer = dict(aux or {})
    unread = sorted(set(layer) - set(names))
    if unread:
        raise RuntimeInputError(f"{where}: aux tensors not read by this wrapper's kernel: {', '.join(unread)} (it "
                                f"reads: {', '.join(names) or 'none'})")
    given = layer | {AUX_ALIBI: alibi_slopes, AUX_SINKS: sinks}
    if any(given[n] is not None and n not in names for n in (AUX_ALIBI, AUX_SINKS)):
        wrapper = where.split(".")[0]
        raise RuntimeInputError(f"{where}: sinks / alibi_slopes are for a wrapper made with them ({wrapper}(..., "
                                "sinks=True or a tensor, alibi_slopes=...))")
    return tuple(defaults.get(n) if given.get(n) is None else given[n] for n in names)


def refuse_missing_aux(where: str, names: tuple, aux: tuple) -> None:
    """A run's aux tensors (`names`' order) all given: the first missing one is named with how to pass it."""
    missing = [n for n, t in zip(names, aux) if t is None or isinstance(t, bool)]
    if missing:
        how = f"{missing[0]}=tensor" if missing[0] in (AUX_ALIBI, AUX_SINKS) else f"aux={{{missing[0]!r}: tensor}}"
        raise RuntimeInputError(f"{where}: this wrapper's kernel reads {', '.join(missing)}: pass run(..., {how}) "
                                "for this layer")


def _dtype(dtype) -> DType:
    """A DType from a torch dtype, a DType, or its name ("bfloat16", "bf16", ...)."""
    if isinstance(dtype, DType):
        return dtype
    name = str(dtype).replace("torch.", "")
    from ..spec import DTYPES
    for d, info in DTYPES.items():
        if name in (d.value, info.torch, info.numpy):
            return d
    raise RuntimeInputError(f"PagedAttention: unsupported dtype {dtype}")


class VarlenAttention:
    """Packed variable-length attention planned once per batch and run once per layer (module docstring).

    num_heads / num_kv_heads / head_dim: the model's; dtype and device as for PagedAttention;
    max_batch sequences and max_items work items (query tiles; None: max_batch x 64) bound a plan.
    dtype float8_e4m3fn is FP8 attention (serving/varlen.py): `descale` "per_head" ((sequences, kv_heads) descales)
    or "per_tensor" and `out_dtype` (bf16 or fp16) pick its kernel; run() then takes q_descale, k_descale and
    v_descale (None: 1.0). Score modifications are part of the wrapper, as in PagedAttention (16-bit only):
    `softcap` (a float), `alibi_slopes` ("geometric", or a float32 (heads,) / (sequences, heads) tensor) and `sinks`
    (a float32 (heads,) tensor, or True: each run passes its layer's `sinks=`), read by pointer on every run.
    `score_mod` / `mask_mod` (varlen_attention's: b the sequence, q_idx and kv_idx positions within it) are fixed
    with the wrapper too, their aux tensors given by name in `aux` or by each run's `aux=` (which replace the
    wrapper's for that run); a run whose tensors need a gradient is refused (varlen has no backward)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, dtype, device, max_batch: int,
                 max_items: int | None = None, causal: bool = False, window: tuple[int, int] | None = None,
                 scale: float | None = None, descale: str | None = None, out_dtype=None, softcap=None,
                 alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None, aux=None):
        from ..dispatch.modified import modifications
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.device, self.max_batch = dtype, device, max_batch
        self.fp8_options = _fp8_options(_dtype(dtype), descale, out_dtype)
        self.mods, tensors = modifications("VarlenAttention", softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                           score_mod=score_mod, mask_mod=mask_mod, aux=aux)
        if self.mods.active and self.fp8_options is not None:
            raise RuntimeInputError("VarlenAttention: FP8 (float8_e4m3fn) attention has no kernel with score "
                                    "modifications; use dtype bf16 or fp16 for them")
        # the runs' aux tensors unless a run passes its own (a traced callable's captured tensors among them)
        self.aux = tensors | {AUX_ALIBI: alibi_slopes, AUX_SINKS: sinks}
        self.expressions = self.mods.score_mod is not None or self.mods.mask_mod is not None
        self.max_items = max_items or max_batch * 64
        self.causal, self.window, self.scale = causal, None if window is None else tuple(window), scale
        self.framework = _framework(device)
        self.metadata = MetadataUpload(device, words_for(max_batch + 1, max_batch + 1, 2 * self.max_items),
                                       self.framework)
        self.planned = None
        self._calls = SignatureCache(64)

    def plan(self, cu_seqlens_q, cu_seqlens_k) -> None:
        """Check this batch's offsets (host int32 (batch + 1,) arrays), order its work longest first and
        upload offsets and work list with one copy."""
        from ..runtime.varlen import visible_keys, work_list
        cu_q, cu_k = _host_int32(cu_seqlens_q, "cu_seqlens_q"), _host_int32(cu_seqlens_k, "cu_seqlens_k")
        if cu_q.ndim != 1 or cu_q.shape[0] - 1 > self.max_batch:
            raise RuntimeInputError(f"plan: cu_seqlens_q must be (batch + 1,) with batch <= {self.max_batch}, got "
                                    f"shape {cu_q.shape}")
        q_lens, k_lens = check_varlen(cu_q, cu_k, int(cu_q[-1]) if cu_q.size else 0,
                                      int(cu_k[-1]) if cu_k.size else 0)
        kernel = self._kernel()
        p, tile_q = kernel.spec.problem, kernel.plan.launch.tile_q
        pairs = work_list(q_lens, k_lens, tile_q, p.mask, p.window_left, p.window_right)
        if len(pairs) > self.max_items:
            raise RuntimeInputError(f"plan: {len(pairs)} work items (query tiles), the wrapper holds {self.max_items} "
                                    "(raise max_items)")
        most = max((visible_keys(int(t) * tile_q, tile_q, int(q_lens[s]), int(k_lens[s]), p.mask, p.window_left,
                                 p.window_right) for s, t in pairs[:1]), default=0)
        cu_q_view, cu_k_view, work_view = self.metadata.upload([cu_q, cu_k, pairs])
        self.planned = (int(cu_q[-1]), int(cu_k[-1]), cu_q_view, cu_k_view, work_view.reshape(-1, 2), len(pairs),
                        most, kernel)
        self.plan_shape = (len(q_lens), int(q_lens.max(initial=0)), int(k_lens.max(initial=0)))

    def _kernel(self):
        from ..runtime.tensors import TensorView
        from .varlen import varlen_kernel
        q = TensorView("q", 0, (1, self.num_heads, self.head_dim), (0, 0, 1), _dtype(self.dtype), 0, None)
        return varlen_kernel(q, q, self.causal, self.window, self.scale, self.fp8_options, self.mods)

    def run(self, q, k, v, out=None, *, lse=None, return_lse: bool = False, q_descale=None, k_descale=None,
            v_descale=None, sinks=None, alibi_slopes=None, aux=None):
        """O (total_q, heads, dv) of the planned batch for one layer's packed q, k, v (into `out`); an FP8 wrapper
        takes the layer's descales. `sinks` / `alibi_slopes` / `aux` (the expressions' tensors by name): this
        layer's, for a wrapper made with them (None: the wrapper's)."""
        if self.planned is None:
            raise RuntimeInputError("VarlenAttention.run: call plan(cu_seqlens_q, cu_seqlens_k) first")
        total_q, total_k, cu_q, cu_k, work, items, most, kernel = self.planned
        descales = kernel.descale_tensors(q_descale, k_descale, v_descale)   # () unless FP8; refused on 16-bit
        aux = layer_aux("VarlenAttention.run", kernel.aux_names, self.aux, aux, sinks, alibi_slopes)
        if self.expressions:
            from .varlen import refuse_gradients
            refuse_gradients("VarlenAttention.run", q, k, v, *aux)
        key = (signature(q), signature(k), signature(v), signature(out), signature(lse), id(work), items, most,
               tuple(map(signature, descales)), tuple(map(signature, aux)))
        call = self._calls.get(key)
        if call is None:
            if signature(q)[0][0] != total_q or signature(k)[0][0] != total_k:
                raise RuntimeInputError(f"VarlenAttention.run: the plan holds {total_q} query and {total_k} key "
                                        f"tokens; q has {signature(q)[0][0]}, k {signature(k)[0][0]}")
            self._check_aux(kernel, aux)
            call = self._calls.put(key, kernel.prepare_call((q, k, v, cu_q, cu_k, out, lse) + aux + descales,
                                                            planned_work=(work, items, most)))
        out, lse = call(q, k, v, cu_q, cu_k, out, lse, *aux, *descales)
        return (out, lse) if return_lse else out

    def _check_aux(self, kernel, aux: tuple) -> None:
        """The run's aux tensors (kernel.aux_names' order) against the plan: given, and of the shapes the
        modifications take (dispatch/modified.check_launch: no sync)."""
        if not aux:
            return
        from ..dispatch.modified import check_launch
        refuse_missing_aux("VarlenAttention.run", kernel.aux_names, aux)
        batch, q_len, kv_len = self.plan_shape
        check_launch(self.mods, dict(zip(kernel.aux_names, aux)), batch, self.num_heads, q_len, kv_len,
                     ragged=True, where="VarlenAttention.run")


def _fp8_options(dtype: DType, descale: str | None, out_dtype) -> tuple | None:
    """VarlenAttention's FP8 kernel choice, (descale granularity, O's dtype), or None for 16-bit inputs (which take
    neither keyword)."""
    from ..spec import Descale
    if dtype is not DType.E4M3:
        if descale is not None or out_dtype is not None:
            raise RuntimeInputError("VarlenAttention: descale and out_dtype are for FP8 attention (dtype "
                                    "float8_e4m3fn)")
        return None
    from ..dispatch.tuned import fp8_out_dtype
    kinds = (Descale.PER_HEAD, Descale.PER_TENSOR)   # per block: packed sequences have no tile index (families)
    kind = Descale.PER_HEAD if descale is None else {k.value: k for k in kinds}.get(getattr(descale, "value", descale))
    if kind is None:
        raise RuntimeInputError(f"VarlenAttention: descale is 'per_head' ((sequences, kv_heads) descales) or "
                                f"'per_tensor' for packed sequences, got {descale!r}")
    return kind, fp8_out_dtype(out_dtype, "VarlenAttention")
