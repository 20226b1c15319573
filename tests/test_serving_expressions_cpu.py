"""score_mod / mask_mod in decode (contiguous and paged, split-KV) and the varlen forward without a GPU: what the
plans and sources spell, the decode walk of mask_mod's tiles compiled for the host against the float64 visibility,
the routing (paged_attention, PagedAttention plan/run, varlen_attention on the stub device: tests/host_stubs.py),
the refusals (FP8 KV caches, gradients through varlen) and the aux checks that name the tensor, before launch."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import tiledsl
from tests.host_stubs import stub_device
from tiledsl import families
from tiledsl.codegen.render import TEMPLATE_DIR, environment, render
from tiledsl.dispatch.modified import modifications
from tiledsl.dispatch.tuned import tuned_spec
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.lower.expressions import expression_fields
from tiledsl.mods.expr import Var, reads
from tiledsl.mods.model import Modifications
from tiledsl.mods.numeric import evaluate
from tiledsl.serving.paged import paged_spec
from tiledsl.serving.varlen import varlen_spec
from tiledsl.spec import DType, KvScale, Mask

from .test_expressions_cpu import PRELUDE, needs_gxx, run_host

BIAS = "score + bias[h, q_idx - kv_idx + 1023]"
WINDOW_GLOBAL = "q_idx - kv_idx < 300 | kv_idx < 64"


def mods_of(**keywords) -> Modifications:
    return modifications("test", **keywords)[0]


def names(plan) -> list[str]:
    return [p.name for line in plan.parameters for p in line]


# ---- plans and sources -----------------------------------------------------------------------------------

@pytest.mark.parametrize("page", [None, 16])
def test_a_decode_plan_spells_score_mod_and_mask_mod(page):
    mods = mods_of(score_mod=BIAS, mask_mod=WINDOW_GLOBAL)
    spec = paged_spec(DType.BF16, 128, 128, Mask.CAUSAL, page or 16, 4, mods=mods)
    if page is None:   # the contiguous cache's decode kernel: the same schedule without the block table
        import dataclasses
        spec = dataclasses.replace(spec, problem=dataclasses.replace(spec.problem, kv_page_size=None))
    plan = families.lower(spec)
    plain = families.lower(paged_spec(DType.BF16, 128, 128, Mask.CAUSAL, 16, 4) if page else
                           dataclasses.replace(spec, problem=dataclasses.replace(spec.problem, mods=Modifications())))
    assert names(plan) == names(plain) + ["aux_bias", "aux_bias_stride0", "aux_bias_stride1"]
    source = render(plan)
    assert "expression_scores(acc_s, expr_rows, key0, lane);" in source
    assert "if (expr_rows.slice_needs_test(key0)) apply_mask_mod(acc_s, expr_rows, key0, lane);" in source
    assert "narrow_to_mask_mod(tile_begin, tile_end, expr_rows);" in source
    # the prefetches load the walk's next visible tile, the ring counts the visits
    assert "if (ahead < tile_end)" in source and "const int stage = (local) % C::STAGES;" in source
    assert "tile_begin + s < tile_end" not in source
    assert f"// score_mod = {BIAS}" in source and f"// mask_mod = {WINDOW_GLOBAL}" in source
    for word in ("decode_expressions.cuh", "expr_rows", "ahead"):
        assert word not in render(plain)
    constants = {c.name: c.value for c in plan.constants}
    assert constants["EXPR_CLAMP"] is True and constants["MASK_MOD_READS_HEAD"] is False


def test_a_score_mod_alone_walks_every_tile_and_a_head_test_takes_each_head():
    plan = families.lower(paged_spec(DType.BF16, 128, 128, Mask.NONE, 16, 1, mods=mods_of(score_mod="score * 0.5")))
    source = render(plan)
    assert "expression_scores(acc_s, expr_rows" in source and "expr_rows.next" not in source
    assert {c.name: c.value for c in plan.constants}["EXPR_CLAMP"] is False   # no aux read: nothing to clamp
    heads = families.lower(paged_spec(DType.BF16, 128, 128, Mask.NONE, 16, 1, mods=mods_of(mask_mod="h % 2 == 0")))
    assert {c.name: c.value for c in heads.constants}["MASK_MOD_READS_HEAD"] is True


def test_fp8_kv_caches_refuse_expressions_and_keep_the_built_ins():
    from tiledsl.spec import KernelSpec
    softcap = paged_spec(DType.BF16, 128, 128, Mask.NONE, 16, 1, kv_dtype=DType.E4M3, kv_scale=KvScale.PER_HEAD,
                         mods=Modifications(softcap=30.0))
    assert families.missing_template(softcap) == ""
    import dataclasses
    spec = KernelSpec("fp8_expr", dataclasses.replace(softcap.problem, mods=mods_of(score_mod=BIAS)), softcap.schedule)
    assert families.missing_template(spec) == ("score and mask modifications (score_mod) have no CUDA template yet "
                                               "for the decode family")
    with pytest.raises(SpecError, match=r"\(score_mod\) have no CUDA template yet"):
        families.lower(spec)


def test_varlen_spells_the_sequence_as_b_and_its_lengths():
    spec = varlen_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, 128, None, None,
                       mods_of(score_mod="score + seq_bias[b, h]", mask_mod=WINDOW_GLOBAL))
    source = render(families.lower(spec))
    assert ("const ExprItem expr_item{w.sequence, w.head, w.seq_q, w.seq_kv, w.seq_q - 1, w.seq_kv - 1, "
            "{aux_seq_bias, aux_seq_bias_stride0, aux_seq_bias_stride1}};") in source
    # the producer and the consumers narrow the same item's tiles and step over the same empty ones
    assert source.count("narrow_to_mask_mod<C>(w.tile_begin, w.tile_end, w.sequence, w.head, w.q0,") == 2
    assert "tile = tiles.next(tile, w.tile_end), ++it" in source and "w.batch" not in source


def test_attention_keeps_expressions_of_a_few_queries_on_the_batched_forward():
    """attention's q_idx is a query's index among the queries; decode's is its position: a few queries with an
    expression run the hopper forward, the built-ins alone still the decode kernels."""
    spec, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, None, None, None, 4, mods_of(score_mod=BIAS))
    assert spec.family.value == "hopper"
    spec, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, None, None, None, 4, Modifications(softcap=30.0))
    assert spec.family.value == "decode"


def test_explain_says_decode_reads_q_idx_as_the_querys_position(capsys):
    """Decode's queries are their sequence's last: explain's score_mod and mask_mod steps give q_idx as the position
    i + kv_len - q_len there; the batched forward's (and varlen's, within each sequence) stays the row i."""
    from pathlib import Path
    from tiledsl.cli.main import main
    mods = Path(__file__).resolve().parent.parent / "specs" / "mods"
    assert main(["explain", str(mods / "decode_expressions_d128.tile")]) in (0, None)
    decode = capsys.readouterr().out
    assert "(score = S, q_idx = i + kv_len - q_len, kv_idx = j)" in decode and "q_idx = i," not in decode
    assert "q_idx - kv_idx < 256 | kv_idx < 16 (mask_mod, q_idx = i + kv_len - q_len)" in decode
    for name in ("expressions_d128.tile", "varlen_expressions_d128.tile"):
        assert main(["explain", str(mods / name)]) in (0, None)
        forward = capsys.readouterr().out
        assert "(score = S, q_idx = i, kv_idx = j)" in forward and "kv_len - q_len, kv_idx" not in forward
        assert "q_idx = i + kv_len" not in forward


# ---- the decode walk, compiled for the host -------------------------------------------------------------------

WALK_MAIN = r"""
static const float NEG_INF = -INFINITY;
inline int acc_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
inline int acc_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }
struct C { static constexpr int BC = 64, KEYS_PER_WARP = 16;
           static constexpr bool EXPR_CLAMP = false, MASK_MOD_READS_HEAD = @READS_HEAD@;
           static constexpr float SCALE = 1.f, INV_SCALE = 1.f; };
struct W : C { static constexpr int M_TILES = 1, S_TILES = 2; };
"""
WALK_LOOP = r"""
int main() {
    int q_len, seq_kv, kv_group, row0;
    while (scanf("%d %d %d %d", &q_len, &seq_kv, &kv_group, &row0) == 4) {
        const int rows_valid = std::min(16, kv_group * q_len - row0);
        const DecodeExprRows x = decode_expr_rows(0, 1, kv_group, row0, rows_valid, q_len, seq_kv, 0, ExprAux{});
        int begin = 0, end = (seq_kv + C::BC - 1) / C::BC;
        narrow_to_mask_mod(begin, end, x);
        printf("tiles");
        for (int tile = begin; tile < end; tile = x.next(tile, end)) printf(" %d", tile);
        printf("\nfull");
        for (int key0 = 0; key0 < seq_kv; key0 += C::KEYS_PER_WARP) printf(" %d", x.slice_needs_test(key0) ? 0 : 1);
        printf("\n");
    }
}
"""


def visible(expr, heads, positions, keys):
    """(heads, queries, keys) visibility of mask_mod at those heads and query positions (mods/numeric.py)."""
    env = {"b": np.int64(0), "h": np.asarray(heads).reshape(-1, 1, 1), "q_idx": np.asarray(positions).reshape(1, -1, 1),
           "kv_idx": np.arange(keys).reshape(1, 1, -1), "q_len": np.int64(len(positions)), "kv_len": np.int64(keys)}
    return np.broadcast_to(evaluate(expr, env, {}), (len(heads), len(positions), keys))


@needs_gxx
@pytest.mark.parametrize("text", [WINDOW_GLOBAL, "kv_idx <= q_idx - 200 | kv_idx < 100",
                                  "(kv_idx // 64) % 3 == 0 | q_idx - kv_idx < 20", "h % 2 == 0 & kv_idx < 500"])
def test_the_decode_walk_visits_the_tiles_with_a_visible_key(text, tmp_path):
    """narrow_to_mask_mod and DecodeExprRows::next over a block's packed rows (several heads, several queries at
    positions kv_len - q_len + i) visit exactly the kv tiles where some row sees some key, and a key slice that
    slice_needs_test passes over holds no hidden key for any row."""
    mods = mods_of(mask_mod=text)
    macro = environment().from_string('{% import "macros.j2" as m %}{{ m.expression_functions(plan) }}')
    reads_head = "true" if any(v.name == "h" for v in reads(mods.mask_mod, Var)) else "false"
    source = "\n".join([PRELUDE, (TEMPLATE_DIR / "expression_ops.cuh").read_text(),
                        macro.render(plan=SimpleNamespace(**expression_fields(mods))),
                        WALK_MAIN.replace("@READS_HEAD@", reads_head),
                        (TEMPLATE_DIR / "decode_expressions.cuh").read_text(), WALK_LOOP])
    cases = [(1, 2000, 8, 0), (4, 1500, 4, 0), (3, 900, 8, 16), (16, 1300, 1, 0), (1, 64, 16, 0), (2, 777, 3, 0)]
    rows = iter(run_host(source, [" ".join(map(str, c)) for c in cases], tmp_path))
    for q_len, seq_kv, kv_group, row0 in cases:
        packed = np.arange(row0, min(row0 + 16, kv_group * q_len))
        heads, queries = kv_group + packed // q_len, packed % q_len   # kv head 1: heads from kv_group
        seen = np.stack([visible(mods.mask_mod, [h], [q + seq_kv - q_len], seq_kv)[0, 0]
                         for h, q in zip(heads, queries)])
        tiles = [int(t) for t in next(rows)[1:]]
        want = [t for t in range(-(-seq_kv // 64)) if seen[:, t * 64:(t + 1) * 64].any()]
        assert tiles == want, (text, q_len, seq_kv, kv_group)
        full = [int(f) for f in next(rows)[1:]]
        for slice_index, is_full in enumerate(full):
            if is_full:
                assert seen[:, slice_index * 16:(slice_index + 1) * 16].all(), (text, slice_index)


# ---- routing on the stub device -------------------------------------------------------------------------

@pytest.fixture
def device(tmp_path):
    counts: dict = {}
    with stub_device(tmp_path, counts) as dev:
        dev.counts = counts
        yield dev


def paged_inputs(device, batch=3, pages_per_seq=8, page=16, kv_heads=8):
    table = device.index(np.arange(batch * pages_per_seq).reshape(batch, pages_per_seq))
    lens = device.index([pages_per_seq * page - 5 * b for b in range(batch)])
    caches = [device.tensor((batch * pages_per_seq, page, kv_heads, 128)) for _ in range(2)]
    return table, lens, caches


def test_a_warm_paged_call_with_expressions_only_launches(device, monkeypatch):
    """The first call of a signature checks the aux tensors (positions: q_idx up to the table's 128 keys) and
    builds the kernel; a warm call reads the pointers (a new bias tensor's too) and launches."""
    import tiledsl.dispatch.modified as modified
    from tests.test_launch_cpu import warm
    checks = []
    real = modified.check_launch
    monkeypatch.setattr(modified, "check_launch", lambda *a, **kw: checks.append(kw) or real(*a, **kw))
    table, lens, (k_cache, v_cache) = paged_inputs(device)
    bias = device.tensor((32, 128 + 1023), "float32")
    call = lambda q: tiledsl.paged_attention(q, k_cache, v_cache, table, lens, causal=True,   # noqa: E731
                                             score_mod=BIAS, mask_mod=WINDOW_GLOBAL, aux={"bias": bias})
    cold, hot, (name, *_, values), (q,) = warm(device, call, lambda: (device.tensor((3, 2, 32, 128)),))
    assert hot == {} and len(checks) == 1 and checks[0]["positions"] is True
    assert name.startswith("decode_d128") and "smod" in name and "mmod" in name and "paged16" in name
    assert values[0] == q.data_ptr() and values[-3] == bias.data_ptr()
    assert [v & 0xFFFFFFFF for v in values[-2:]] == [128 + 1023, 1]   # the bias's strides in elements
    other = device.tensor((32, 128 + 1023), "float32")
    tiledsl.paged_attention(q, k_cache, v_cache, table, lens, causal=True, score_mod=BIAS, mask_mod=WINDOW_GLOBAL,
                            aux={"bias": other})
    assert device.last()[-1][-3] == other.data_ptr() and len(checks) == 1


@pytest.mark.parametrize("keywords, match", [
    (lambda d: dict(score_mod=BIAS, aux={"bias": d.tensor((32, 1100), "float32")}),
     r"paged_attention: score_mod reads bias\[h, q_idx - kv_idx \+ 1023\]: index 1 \(q_idx - kv_idx \+ 1023\) "
     r"can reach 896\.\.1150 for this launch, outside bias's 0\.\.1099"),
    (lambda d: dict(score_mod=BIAS, aux={"bias": d.tensor((31, 1200), "float32")}),
     r"index 0 \(h\) can reach 0\.\.31 for this launch, outside bias's 0\.\.30"),
    (lambda d: dict(score_mod=BIAS), r"paged_attention: aux tensor 'bias' is missing"),
    (lambda d: dict(score_mod=BIAS, aux={"bias": d.tensor((32, 1200), "float16")}),
     r"bias must be float32"),
    (lambda d: dict(mask_mod="keep[b, kv_idx] != 0", aux={"keep": d.tensor((3, 128), "float32")}),
     r"mask_mod reads keep as int or bool \(a mask_mod's tables\); the tensor is float"),
])
def test_bad_aux_tensors_are_refused_by_name_before_launch(device, keywords, match):
    table, lens, (k_cache, v_cache) = paged_inputs(device)
    q = device.tensor((3, 1, 32, 128))
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match=match):
        tiledsl.paged_attention(q, k_cache, v_cache, table, lens, **keywords(device))
    assert len(device.launches) == launches


def test_paged_expressions_over_an_fp8_cache_and_in_chunked_prefill_are_refused(device):
    table, lens, _ = paged_inputs(device)
    caches = [device.tensor((24, 16, 8, 128), "float8_e4m3fn") for _ in range(2)]
    scale = device.tensor((8,), "float32")
    with pytest.raises(RuntimeInputError, match=r"paged_attention: score_mod / mask_mod over an FP8 "
                                                r"\(float8_e4m3fn\) KV cache have no CUDA template yet"):
        tiledsl.paged_attention(device.tensor((3, 1, 32, 128)), *caches, table, lens, k_scale=scale, v_scale=scale,
                                mask_mod=WINDOW_GLOBAL)
    _, _, (k_cache, v_cache) = paged_inputs(device)
    with pytest.raises(RuntimeInputError, match=r"chunked prefill \(q_len > 16\) with modifications"):
        tiledsl.paged_attention(device.tensor((3, 17, 32, 128)), k_cache, v_cache, table, lens,
                                mask_mod=WINDOW_GLOBAL)


def test_planned_paged_runs_take_each_layers_aux(device):
    paged = tiledsl.PagedAttention(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, num_pages=24,
                                   dtype="bfloat16", device=device.torch.device("cuda", 0), max_batch=4, max_pages=8,
                                   causal=True, score_mod=BIAS, mask_mod=WINDOW_GLOBAL)
    paged.plan(np.arange(24, dtype=np.int32).reshape(3, 8), np.array([128, 100, 1], np.int32), q_len=2)
    _, _, (k_cache, v_cache) = paged_inputs(device)
    q = device.tensor((3, 2, 32, 128))
    with pytest.raises(RuntimeInputError, match=r"reads bias: pass run\(\.\.\., aux=\{'bias': tensor\}\)"):
        paged.run(q, k_cache, v_cache)
    for _ in range(2):
        bias = device.tensor((32, 2047), "float32")
        paged.run(q, k_cache, v_cache, aux={"bias": bias})
        name, *_, values = device.last()
        assert "smod" in name and "mmod" in name and values[-3] == bias.data_ptr()
    with pytest.raises(RuntimeInputError, match=r"PagedAttention.run: score_mod reads bias.*outside bias's 0\.\.99"):
        paged.run(q, k_cache, v_cache, aux={"bias": device.tensor((32, 100), "float32")})
    with pytest.raises(RuntimeInputError, match="aux tensors not read by this wrapper's kernel: other"):
        paged.run(q, k_cache, v_cache, aux={"bias": bias, "other": bias})
    with pytest.raises(RuntimeInputError, match="PagedAttention.run: sinks / alibi_slopes are for a wrapper made "
                                                "with them"):   # read by no kernel of this wrapper: not ignored
        paged.run(q, k_cache, v_cache, aux={"bias": bias}, sinks=device.tensor((32,), "float32"))


CU = [0, 1, 18, 1018]   # three sequences: 1, 17 and 1000 tokens
TOTAL, HEADS, KV_HEADS = 1018, 16, 4


def test_a_warm_varlen_call_with_expressions_only_launches(device):
    from tests.test_launch_cpu import warm
    cu = device.index(CU)
    seq_bias = device.tensor((3, HEADS), "float32")

    def fresh():
        return (device.tensor((TOTAL, HEADS, 128)), device.tensor((TOTAL, KV_HEADS, 128)),
                device.tensor((TOTAL, KV_HEADS, 128)))
    call = lambda q, k, v: tiledsl.varlen_attention(q, k, v, cu, cu, 1000, 1000, causal=True,   # noqa: E731
                                                    score_mod="score + seq_bias[b, h]", mask_mod=WINDOW_GLOBAL,
                                                    aux={"seq_bias": seq_bias})
    cold, hot, (name, *_, values), (q, k, v) = warm(device, call, fresh)
    assert hot == {} and "varlen" in name and "smod" in name and "mmod" in name
    assert values[-3] == seq_bias.data_ptr() and [x & 0xFFFFFFFF for x in values[-2:]] == [HEADS, 1]
    with pytest.raises(RuntimeInputError, match=r"seq_bias\[b, h\]: index 0 \(b\) can reach 0\.\.2"):
        tiledsl.varlen_attention(q, k, v, cu, cu, score_mod="score + seq_bias[b, h]",
                                 aux={"seq_bias": device.tensor((2, HEADS), "float32")})


def test_varlen_expressions_refuse_a_gradient(device):
    cu = device.index(CU)
    q, k, v = (device.tensor((TOTAL, h, 128)) for h in (HEADS, KV_HEADS, KV_HEADS))
    q.requires_grad = True
    with pytest.raises(RuntimeInputError, match="the varlen kernels have no backward"):
        tiledsl.varlen_attention(q, k, v, cu, cu, 1000, 1000, mask_mod=WINDOW_GLOBAL)


SEQ_BIAS = "score + seq_bias[b, h]"


def planned_varlen(device, **keywords):
    varlen = tiledsl.VarlenAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, dtype="bfloat16",
                                     device=device.torch.device("cuda", 0), max_batch=4, causal=True, **keywords)
    varlen.plan(np.array(CU, np.int32), np.array(CU, np.int32))
    return varlen


def packed_inputs(device):
    return tuple(device.tensor((TOTAL, h, 128)) for h in (HEADS, KV_HEADS, KV_HEADS))


def test_planned_varlen_runs_take_each_layers_aux_and_only_launch(device, monkeypatch):
    """VarlenAttention with score_mod / mask_mod runs varlen_attention's kernel with its arguments: the first run of
    a signature checks the aux tensors against the plan's sequences, a warm run reads each layer's pointers and
    launches (no parse, graph, render or compile)."""
    import tiledsl.dispatch.modified as modified
    from tests.test_launch_cpu import guarded_calls
    checks = []
    real = modified.check_launch
    monkeypatch.setattr(modified, "check_launch", lambda *a, **kw: checks.append(kw) or real(*a, **kw))
    varlen = planned_varlen(device, score_mod=SEQ_BIAS, mask_mod=WINDOW_GLOBAL)
    q, k, v = packed_inputs(device)
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match=r"VarlenAttention.run: this wrapper's kernel reads seq_bias: pass "
                                                r"run\(\.\.\., aux=\{'seq_bias': tensor\}\) for this layer"):
        varlen.run(q, k, v)
    assert len(device.launches) == launches and checks == []
    varlen.run(q, k, v, out=device.tensor((TOTAL, HEADS, 128)),
               aux={"seq_bias": device.tensor((3, HEADS), "float32")})
    assert len(checks) == 1 and guarded_calls(device), "the first run should have built its kernel"
    device.counts.clear()
    for _ in range(2):
        q, k, v = packed_inputs(device)
        seq_bias, out = device.tensor((3, HEADS), "float32"), device.tensor((TOTAL, HEADS, 128))
        launches = len(device.launches)
        assert varlen.run(q, k, v, out=out, aux={"seq_bias": seq_bias}) is out
        assert len(device.launches) == launches + 1
        name, *_, values = device.last()
        assert values[0] == q.data_ptr() and out.data_ptr() in values
        assert values[-3] == seq_bias.data_ptr() and [x & 0xFFFFFFFF for x in values[-2:]] == [HEADS, 1]
    assert guarded_calls(device) == {} and len(checks) == 1
    # the same kernel, the same parameter list, the same aux arguments as the function's bounded call
    cu = device.index(CU)
    tiledsl.varlen_attention(q, k, v, cu, cu, 1000, 1000, causal=True, score_mod=SEQ_BIAS, mask_mod=WINDOW_GLOBAL,
                             aux={"seq_bias": seq_bias})
    function_name, *_, function_values = device.last()
    assert function_name == name and "varlen" in name and "smod" in name and "mmod" in name
    assert len(function_values) == len(values) and function_values[-3:] == values[-3:]


def test_planned_varlen_aux_defaults_to_the_wrappers_and_refuses_bad_ones_by_name(device):
    bias = device.tensor((3, HEADS), "float32")
    varlen = planned_varlen(device, score_mod=SEQ_BIAS, aux={"seq_bias": bias})
    q, k, v = packed_inputs(device)
    varlen.run(q, k, v)
    assert device.last()[-1][-3] == bias.data_ptr()
    layer = device.tensor((3, HEADS), "float32")
    varlen.run(q, k, v, aux={"seq_bias": layer})   # the run's replaces the wrapper's for that run
    assert device.last()[-1][-3] == layer.data_ptr()
    launches = len(device.launches)
    with pytest.raises(RuntimeInputError, match=r"VarlenAttention.run: aux tensors not read by this wrapper's "
                                                r"kernel: other \(it reads: seq_bias\)"):
        varlen.run(q, k, v, aux={"seq_bias": layer, "other": layer})
    with pytest.raises(RuntimeInputError, match=r"VarlenAttention.run: score_mod reads seq_bias\[b, h\]: index 0 "
                                                r"\(b\) can reach 0\.\.2 for this launch"):
        varlen.run(q, k, v, aux={"seq_bias": device.tensor((2, HEADS), "float32")})
    with pytest.raises(RuntimeInputError, match=r"seq_bias must be float32, got torch.float16"):
        varlen.run(q, k, v, aux={"seq_bias": device.tensor((3, HEADS), "float16")})
    with pytest.raises(RuntimeInputError, match="VarlenAttention.run: sinks / alibi_slopes are for a wrapper made "
                                                "with them"):
        varlen.run(q, k, v, sinks=device.tensor((HEADS,), "float32"))
    q.requires_grad = True
    with pytest.raises(RuntimeInputError, match="VarlenAttention.run: the varlen kernels have no backward"):
        varlen.run(q, k, v)
    assert len(device.launches) == launches
    plain = planned_varlen(device)
    with pytest.raises(RuntimeInputError, match=r"aux tensors not read by this wrapper's kernel: seq_bias \(it "
                                                r"reads: none\)"):
        plain.run(*packed_inputs(device), aux={"seq_bias": bias})


def test_planned_varlen_expressions_check_the_aux_against_each_plan(device):
    """The aux check follows the plan: (sequences, heads) fits three sequences, not a re-plan of four."""
    varlen = planned_varlen(device, mask_mod="keep[b] != 0")
    q, k, v = packed_inputs(device)
    keep = device.tensor((3,), "int32")
    varlen.run(q, k, v, aux={"keep": keep})
    assert device.last()[-1][-2] == keep.data_ptr()
    varlen.plan(np.array([0, 1, 18, 500, 1018], np.int32), np.array([0, 1, 18, 500, 1018], np.int32))
    with pytest.raises(RuntimeInputError, match=r"VarlenAttention.run: mask_mod reads keep\[b\]: index 0 \(b\) "
                                                r"can reach 0\.\.3 for this launch"):
        varlen.run(q, k, v, aux={"keep": keep})


def test_an_fp8_varlen_wrapper_refuses_expressions():
    with pytest.raises(RuntimeInputError, match="VarlenAttention: FP8 .* no kernel with score modifications"):
        tiledsl.VarlenAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, dtype="float8_e4m3fn",
                                device="cuda", max_batch=4, mask_mod=WINDOW_GLOBAL)


# ---- the float64 paged reference: decode's positions ------------------------------------------------------

def test_the_paged_reference_reads_q_idx_as_positions():
    """A bias by query position and a window against it, through the paged reference, equal a naive softmax over
    the positions kv_len - queries + i (a sequence of no keys: O = 0, LSE = -inf)."""
    from tiledsl.reference import serving
    rng = np.random.default_rng()
    page, lens = 8, np.array([40, 0, 19], dtype=np.int32)
    table = rng.permutation(18).astype(np.int32).reshape(3, 6)
    k_cache, v_cache = (rng.standard_normal((18, page, 2, 16)) for _ in range(2))
    q = rng.standard_normal((3, 3, 4, 16))
    bias = rng.standard_normal((4, 64))
    mods = mods_of(score_mod="score + bias[h, q_idx]", mask_mod="q_idx - kv_idx < 7 | kv_idx == 0")
    o, lse = serving.paged_attention(q, k_cache, v_cache, table, lens, mods=mods, aux={"bias": bias})
    for b, n in enumerate(lens):
        keys, values = (serving.gather_pages(c, table[b], int(n)) for c in (k_cache, v_cache))
        for i in range(3):
            position = max(int(n) - 3 + i, 0)   # the aux read's clamp at 0
            for h in range(4):
                s = keys[:, h // 2] @ q[b, i, h] / 4.0 + bias[h, position]
                seen = ((int(n) - 3 + i) - np.arange(int(n)) < 7) | (np.arange(int(n)) == 0)
                if not seen.any():
                    assert lse[b, i, h] == -np.inf and not o[b, i, h].any()
                    continue
                w = np.where(seen, np.exp(s - s[seen].max()), 0.0)
                assert np.allclose(o[b, i, h], w @ values[:, h // 2] / w.sum(), atol=1e-12)
                assert np.isclose(lse[b, i, h], np.log(w.sum()) + s[seen].max(), atol=1e-12)


def test_spec_for_prints_the_paged_and_varlen_specs():
    q = SimpleNamespace(shape=(2, 4, 32, 128), dtype="torch.bfloat16")
    kv = SimpleNamespace(shape=(64, 16, 8, 128), dtype="torch.bfloat16")
    text = tiledsl.spec_for(q, kv, kv, causal=True, layout="paged", score_mod=BIAS, arch="sm_90a")
    assert f"score_mod = {BIAS}" in text and "queries" in text and "kv_cache" in text
    spec = tiledsl.parse_text(text)[0]
    assert spec.family.value == "decode" and spec.problem.mods.score_mod is not None
    packed = SimpleNamespace(shape=(1018, 16, 128), dtype="torch.bfloat16")
    text = tiledsl.spec_for(packed, packed, packed, causal=True, layout="varlen", mask_mod=WINDOW_GLOBAL,
                            arch="sm_90a")
    spec = tiledsl.parse_text(text)[0]
    assert spec.problem.seq_layout.value == "varlen" and spec.problem.mods.mask_mod is not None
