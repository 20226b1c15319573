"""The aux tensors of a kernel with score and mask modifications (mods/model.py: ALiBi's slopes, the sinks,
the documents): the names a call passes them by (aux={name: tensor}, after the kernel class's CALL), their
checks (element type, shape, contiguity, device: no sync) and the launch arguments of
lower/score_mods.mod_parameters, which every modified kernel appends in that order. Geometric ALiBi slopes
are the host's, made once per device and head count."""
from __future__ import annotations

import math

from ..errors import RuntimeInputError
from ..lower.expressions import expression_aux
from ..mods.checks import check_aux
from ..mods.expr import Type
from ..mods.model import AUX_ALIBI, AUX_BLOCK_MASK, AUX_DOCUMENT_BOUNDS, AUX_DOCUMENT_IDS, AUX_DROPOUT, AUX_SINKS, \
    DROPOUT_PARAMETERS, AlibiSlopes, Documents, geometric_slopes
from .inputs import Shapes
from .launch import Arg, CallBuilder, i32, i64, is_compact, pointer_arg
from .tensors import LaunchValue, TensorView, view

# Modifications' fields besides the expressions: expression_args checks the expressions' aux tensors alone.
BUILT_IN_FIELDS = ("softcap", "softcap_via", "alibi", "sinks", "document", "prefix", "blocks", "dropout")


def aux_names(spec) -> tuple[str, ...]:
    """The aux tensors a call of `spec`'s kernel passes by name, in CALL order (geometric slopes: none), then
    dropout's seed and offset (LaunchValues: the (seed, offset) pair aux names AUX_DROPOUT, launch_aux)."""
    mods = spec.problem.mods
    return tuple(a.name for a in mods.user_aux()) + (DROPOUT_PARAMETERS if mods.dropout is not None else ())


def launch_aux(aux: dict) -> dict:
    """`aux` with dropout's (seed, offset) (AUX_DROPOUT) as the two LaunchValues a call passes in its place."""
    if AUX_DROPOUT not in aux:
        return aux
    pair = aux[AUX_DROPOUT]
    if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2:
        raise RuntimeInputError(f"{AUX_DROPOUT} must be (seed, offset), two ints, got {pair!r}")
    out = {name: value for name, value in aux.items() if name != AUX_DROPOUT}
    for name, value in zip(DROPOUT_PARAMETERS, pair):
        out[name] = value if type(value) is LaunchValue else LaunchValue(value, f"{AUX_DROPOUT}'s {name}")
    return out


class AuxArguments:
    """A kernel class's aux tensors: `self.aux_names` (aux_names) follow its CALL's own tensors.
    QUERY_POSITIONS: the kernel's expressions read q_idx as a query's position in its sequence (decode's
    kv_len - q_len + i), not its index among the queries."""
    QUERY_POSITIONS = False

    def aux_tensors(self, aux) -> tuple:
        """The aux tensors of `aux` (name -> tensor) in CALL order; a missing or unexpected name is refused."""
        if not aux and not self.aux_names:
            return ()
        aux = launch_aux(dict(aux or {}))
        missing = [n for n in self.aux_names if aux.get(n) is None]
        extra = sorted(set(aux) - set(self.aux_names))
        if missing or extra:
            wants = ", ".join(self.aux_names) or "none"
            raise RuntimeInputError(f"{self.name}: aux tensors {'missing ' + ', '.join(missing) if missing else ''}"
                                    f"{'; ' if missing and extra else ''}"
                                    f"{'not read by this kernel: ' + ', '.join(extra) if extra else ''} "
                                    f"(it reads: {wants})")
        return tuple(aux[n] for n in self.aux_names)

    def mod_args(self, b: CallBuilder, shapes: Shapes, ragged: bool = False) -> tuple:
        """The launch arguments of lower/score_mods.mod_parameters: each aux tensor checked (float32, contiguous,
        on q's GPU, its shape), geometric ALiBi slopes made for the launch's head count, then the expressions'
        (expression_args)."""
        mods, args = self.spec.problem.mods, ()
        if mods.alibi is AlibiSlopes.GEOMETRIC:
            slopes = geometric_slope_tensor(b.like, b.device_id, shapes.heads)
            b.keep.append(slopes)
            args += (pointer_arg(view(slopes, AUX_ALIBI)), i32(0))
        elif mods.alibi is AlibiSlopes.GIVEN:
            t = self._aux_view(b, AUX_ALIBI, ((shapes.heads,), (shapes.batch, shapes.heads)))
            args += (pointer_arg(t), i32(shapes.heads if len(t.shape) == 2 else 0))
        if mods.sinks:
            args += (pointer_arg(self._aux_view(b, AUX_SINKS, ((shapes.heads,),))),)
        if mods.document is Documents.IDS:
            t = self._aux_view(b, AUX_DOCUMENT_IDS, ((shapes.batch, shapes.kv_len),), "int32")
            args += (pointer_arg(t), i64(t.strides[0]))
        elif mods.document is Documents.BOUNDS:
            t = self._aux_view(b, AUX_DOCUMENT_BOUNDS, None, "int32")
            if len(t.shape) != 2 or t.shape[0] != shapes.batch or t.shape[1] < 1:
                raise RuntimeInputError(f"{self.name}: {AUX_DOCUMENT_BOUNDS} has shape {t.shape}; this launch needs "
                                        f"({shapes.batch}, documents + 1)")
            args += (pointer_arg(t), i64(t.strides[0]), i32(t.shape[1]))
        if mods.blocks is not None:
            args += self._block_mask_args(b, shapes)
        return args + self.expression_args(b, shapes, ragged) + self.dropout_args(b)

    def dropout_args(self, b: CallBuilder) -> tuple:
        return tuple(dropout_arguments(b, self.name, self.CALL, self.spec.problem.mods).values())

    def expression_args(self, b: CallBuilder, shapes: Shapes, ragged: bool) -> tuple:
        """lower/expressions.expression_parameters' arguments: each aux tensor an expression reads (float32 or
        int32, contiguous, on q's GPU, under 2^31 elements: the kernel's offsets are int32) as a pointer and its
        strides, after mods/checks.check_aux's refusals on the shapes (no sync): every index the expressions can
        form over this launch inside its tensor, every int inside int32. `ragged`: kv_lens may shorten the
        sequences, so an expression's kv_len may be anything in 0..kv_len."""
        views = expression_views(b, self.name, self.CALL, self.spec.problem.mods, shapes, ragged,
                                 self.QUERY_POSITIONS)
        return tuple(arg for t in views.values() for arg in (pointer_arg(t),) + tuple(i32(s) for s in t.strides))

    def _block_mask_args(self, b: CallBuilder, shapes: Shapes) -> tuple:
        """block_mask_arguments' launch arguments; a sequence longer than a kernel's kv tile list is refused."""
        from ..layout.hopper import LISTED_TILES
        tile_kv = self.spec.schedule.tile_kv
        if -(-shapes.kv_len // tile_kv) > LISTED_TILES:
            raise RuntimeInputError(f"{self.name}: {AUX_BLOCK_MASK}: {shapes.kv_len} keys are "
                                    f"{-(-shapes.kv_len // tile_kv)} kv tiles of {tile_kv}; a q tile lists at most "
                                    f"{LISTED_TILES} (at most {LISTED_TILES * tile_kv} keys)")
        t, batch_stride, head_stride, kv_blocks = block_mask_arguments(
            b, self.name, self.CALL, self.spec.problem.mods.blocks, shapes.batch, shapes.heads, shapes.q_len,
            shapes.kv_len)
        return (pointer_arg(t), i64(batch_stride), i64(head_stride), i32(kv_blocks))

    def _aux_view(self, b: CallBuilder, name: str, shapes: tuple | None, dtype="fp32") -> TensorView:
        return aux_view(b, self.name, self.CALL, name, shapes, dtype)


def expression_views(b: CallBuilder, kernel: str, call: tuple, mods, shapes: Shapes, ragged: bool,
                     positions: bool = False) -> dict:
    """{name: view} of the aux tensors the expressions read, in lower/expressions.expression_parameters' order,
    checked as AuxArguments.expression_args says (`positions`: AuxArguments.QUERY_POSITIONS)."""
    views = {a.name: aux_view(b, kernel, call, a.name, None, "fp32" if a.dtype is Type.FLOAT else "int32")
             for a in expression_aux(mods)}
    for name, t in views.items():
        if math.prod(t.shape) >= 1 << 31:
            raise RuntimeInputError(f"{kernel}: {name} has {math.prod(t.shape)} elements; the kernel indexes "
                                    "aux tensors with 32-bit offsets (under 2^31 elements)")
    if views:
        check_aux(mods.without(*BUILT_IN_FIELDS), {n: (t.shape, t.dtype != "int32") for n, t in views.items()},
                  shapes.batch, shapes.heads, shapes.q_len, shapes.kv_len, [0, shapes.kv_len] if ragged else None,
                  kernel, positions=positions)
    return views


def dropout_arguments(b: CallBuilder, kernel: str, call: tuple, mods) -> dict:
    """Dropout's seed and offset by parameter name (none without dropout): the LaunchValues in the call's slots,
    so a warm call writes each call's pair where a pointer would be written."""
    if mods.dropout is None:
        return {}
    out = {}
    for name in DROPOUT_PARAMETERS:
        index = call.index(name)
        value = b.tensors[index] if len(b.tensors) == len(call) else None
        if type(value) is not LaunchValue:
            raise RuntimeInputError(f"{kernel}: {name} is dropout's; pass aux={{{AUX_DROPOUT!r}: (seed, offset)}} to "
                                    "the kernel's call")
        out[name] = Arg("u64", value.value, -1 if b.immediate else index)
    return out


def aux_view(b: CallBuilder, kernel: str, call: tuple, name: str, shapes: tuple | None, dtype="fp32") -> TensorView:
    """The aux tensor `name` of a call whose tensors are named `call` (`kernel`'s), checked: its element type
    (float32 or int32), one of `shapes` (None: the caller checks), contiguous, on q's GPU."""
    if len(b.tensors) != len(call):
        raise RuntimeInputError(f"{kernel}: {name} is an aux tensor of the call: pass aux={{{name!r}: ...}} "
                                "to the kernel's call or bind")
    given = str(getattr(b.tensors[call.index(name)], "dtype", ""))
    if not given.endswith("int32" if dtype == "int32" else "float32"):
        raise RuntimeInputError(f"{kernel}: {name} must be {'int32' if dtype == 'int32' else 'float32'}, "
                                f"got {given or type(b.tensors[call.index(name)]).__name__}")
    t = b.view(call.index(name))
    if shapes is not None and t.shape not in shapes:
        raise RuntimeInputError(f"{kernel}: {name} has shape {t.shape}; this launch needs "
                                f"{' or '.join(map(str, shapes))}")
    if not is_compact(t.shape, t.strides):
        raise RuntimeInputError(f"{kernel}: {name} must be contiguous, got strides {t.strides}")
    if t.device_id != b.device_id:
        raise RuntimeInputError(f"{kernel}: {name} is on GPU {t.device_id}, q on GPU {b.device_id}")
    return t


def block_mask_arguments(b: CallBuilder, kernel: str, call: tuple, blocks: tuple[int, int], batch: int, heads: int,
                         q_len: int, kv_len: int) -> tuple:
    """(block_mask's view, its batch stride, head stride, kv blocks) of a block-sparse kernel's launch: the table
    checked as int32 (batch or 1, heads or 1, q blocks, kv blocks), contiguous, on q's GPU, under 2^31 entries
    (the kernels index it with 32-bit offsets); a stride is 0 where a dimension of 1 serves every batch entry or
    head."""
    counts = (-(-q_len // blocks[0]), -(-kv_len // blocks[1]))
    accepted = tuple((n, h) + counts for n in (batch, 1) for h in (heads, 1))
    t = aux_view(b, kernel, call, AUX_BLOCK_MASK, accepted, "int32")
    if t.shape[0] * t.shape[1] * t.shape[2] * t.shape[3] >= 2 ** 31:
        raise RuntimeInputError(f"{kernel}: {AUX_BLOCK_MASK} has {t.shape} entries, 2^31 or more; the kernels "
                                "index it with 32-bit offsets (a broadcast (1, 1, ...) table, or larger blocks)")
    return t, (t.strides[0] if t.shape[0] > 1 else 0), (t.strides[1] if t.shape[1] > 1 else 0), t.shape[3]


_GEOMETRIC: dict[tuple[str, int, int], object] = {}   # (framework, device, heads) -> ALiBi's slopes, float32


def geometric_slope_tensor(like, device_id: int, heads: int):
    """ALiBi's geometric slopes for `heads` on `like`'s device, made once (a host copy, so the first
    call of a head count only: a captured call finds them made)."""
    torch_like = type(like).__module__.startswith("torch")
    key = ("torch" if torch_like else "cupy", device_id, heads)
    found = _GEOMETRIC.get(key)
    if found is None:
        slopes = geometric_slopes(heads)
        if torch_like:
            import torch
            found = torch.tensor(slopes, dtype=torch.float32, device=like.device)
        else:
            from .device import cupy_module
            cupy = cupy_module()
            with cupy.cuda.Device(device_id):
                found = cupy.asarray(slopes, dtype=cupy.float32)
        _GEOMETRIC[key] = found
    return found

