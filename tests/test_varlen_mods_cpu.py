"""softcap, ALiBi and sinks in the hopper varlen kernel without a GPU: the specs build (families.BUILT_MODS's varlen
entry) and render the packed work item's sequence as ALiBi's slope row, documents / prefix / expressions / FP8
stay refused with the reason, and on the stub device (tests/host_stubs.py) varlen_attention and the planned
VarlenAttention pass the aux tensors after the kernel's own parameters, check them on a signature's first call
only and refuse bad ones by name."""
from __future__ import annotations

import numpy as np
import pytest

import tiledsl
from tests.host_stubs import stub_device
from tiledsl.codegen.render import render
from tiledsl.errors import RuntimeInputError, SpecError
from tiledsl.families import lower, missing_template
from tiledsl.frontend.parse import parse_text
from tiledsl.mods.model import AlibiSlopes, Modifications
from tiledsl.serving.varlen import varlen_spec
from tiledsl.spec import DType, Mask

MODS = {"softcap": Modifications(softcap=30.0), "alibi": Modifications(alibi=AlibiSlopes.GIVEN),
        "geometric": Modifications(alibi=AlibiSlopes.GEOMETRIC), "sinks": Modifications(sinks=True),
        "all": Modifications(softcap=20.0, alibi=AlibiSlopes.GIVEN, sinks=True)}


def parameter_names(plan) -> list[str]:
    return [p.name for line in plan.parameters for p in line]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mod", sorted(MODS))
def test_varlen_specs_with_score_modifications_build(mod, d):
    spec = varlen_spec("sm_90a", DType.BF16, d, Mask.CAUSAL, d, None, None, MODS[mod])
    assert missing_template(spec) == "" and "_varlen_" in spec.kernel_name
    assert set(MODS[mod].name_parts()) <= set(spec.kernel_name.split("_"))
    plan = lower(spec)
    names = parameter_names(plan)
    # the mods' parameters follow the varlen kernel's own (the runtime appends AuxArguments.mod_args there)
    tail = {"softcap": [], "alibi": ["alibi_slopes", "alibi_batch_stride"], "sinks": ["sinks"],
            "geometric": ["alibi_slopes", "alibi_batch_stride"],
            "all": ["alibi_slopes", "alibi_batch_stride", "sinks"]}[mod]
    assert names[len(names) - len(tail):] == tail and names[len(names) - len(tail) - 1] == "items"
    source = render(plan)
    assert plan.template == "hopper_varlen.cu.j2" and "w.batch" not in source
    if MODS[mod].alibi is not None:   # the packed work item's sequence picks a (sequence, head) slope row
        assert "alibi_slopes[w.sequence * alibi_batch_stride + w.head] * C::ALIBI_UNITS" in source
    if MODS[mod].sinks:
        assert "row_max[0][0] = row_max[0][1] = sinks[w.head] * C::SINK_UNITS;" in source
    if MODS[mod].softcap is not None:
        assert "softcap_scores<C>(acc_s);" in source


def test_the_batched_kernel_keeps_its_batch_row():
    from tiledsl.dispatch.tuned import tuned_spec
    spec, _ = tuned_spec("sm_90a", DType.BF16, 128, Mask.CAUSAL, 128, None, None, None, MODS["alibi"])
    assert "alibi_slopes[w.batch * alibi_batch_stride + w.head] * C::ALIBI_UNITS" in render(lower(spec))


SPEC = """attention varlen_mod {{
    head_dim = 128
    dtype    = {dtype}
    mask     = {mask}
    layout   = varlen
    {extra}
    schedule {{
        tile       q = 128, kv = 128
        warpgroups producer 1 regs 24, consumer 2 regs 240
        pipeline   2 stages via tma
    }}
}}
"""


@pytest.mark.parametrize("mask, extra, refused", [
    ("causal & document", "", "document"), ("prefix(16)", "", "prefix"),
])
def test_documents_and_prefix_stay_refused_on_varlen(mask, extra, refused):
    spec = parse_text(SPEC.format(dtype="bf16", mask=mask, extra=extra))[0]
    why = missing_template(spec)
    assert why == (f"score and mask modifications ({refused}) have no CUDA template yet for the hopper family's "
                   "varlen kernels")
    with pytest.raises(SpecError) as err:
        lower(spec)
    assert err.value.message == why


def test_a_spec_written_with_softcap_on_varlen_compiles():
    spec = parse_text(SPEC.format(dtype="bf16", mask="causal", extra="softcap = 30\n    sinks = per_head"))[0]
    plan = lower(spec)
    assert plan.softcap and plan.sinks and plan.template == "hopper_varlen.cu.j2"


@pytest.fixture
def device(tmp_path):
    counts: dict = {}
    with stub_device(tmp_path, counts) as dev:
        dev.counts = counts
        yield dev


def int32_of(value: int) -> int:
    return value & 0xFFFFFFFF   # an int parameter's 4 bytes (the stub reads 8)


CU = [0, 100, 350, 351]   # three sequences: 100, 250 and 1 token
TOTAL, HEADS, KV_HEADS = 351, 16, 4


def packed(device):
    return (device.tensor((TOTAL, HEADS, 128)), device.tensor((TOTAL, KV_HEADS, 128)),
            device.tensor((TOTAL, KV_HEADS, 128)))


@pytest.mark.parametrize("slopes_shape", [(HEADS,), (3, HEADS)], ids=["per-head", "per-sequence"])
def test_a_warm_modified_varlen_call_only_launches(device, monkeypatch, slopes_shape):
    """The first call of a signature checks the aux tensors and picks the kernel; a warm call reads pointers
    (max_seqlen given: no host read) and launches: the slopes, their row stride (heads for (sequences, heads)
    slopes, 0 for (heads,)) and the sinks after the kernel's own parameters."""
    import tiledsl.dispatch.modified as modified
    from tests.test_launch_cpu import warm
    checks = []
    real = modified.check_launch
    monkeypatch.setattr(modified, "check_launch", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    cu = device.index(CU)
    slopes, sinks = device.tensor(slopes_shape, "float32"), device.tensor((HEADS,), "float32")
    call = lambda q, k, v: tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, causal=True,   # noqa: E731
                                                    softcap=30.0, alibi_slopes=slopes, sinks=sinks)
    cold, hot, (name, *_, values), (q, k, v) = warm(device, call, lambda: packed(device))
    assert hot == {} and len(checks) == 1
    assert "varlen" in name and "softcap30" in name and "alibis" in name and "sinks" in name
    assert values[0] == q.data_ptr() and cu.data_ptr() in values
    stride = HEADS if len(slopes_shape) == 2 else 0
    assert [values[-3], int32_of(values[-2]), values[-1]] == [slopes.data_ptr(), stride, sinks.data_ptr()]
    # another sinks tensor of the same signature: the same prepared call, the new pointer
    other = device.tensor((HEADS,), "float32")
    tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, causal=True, softcap=30.0, alibi_slopes=slopes, sinks=other)
    assert device.last()[-1][-1] == other.data_ptr() and len(checks) == 1


def stub_geometric_slopes(device, monkeypatch) -> dict:
    """The host's geometric slopes as stub tensors (the fake torch makes no tensor from data): heads -> tensor."""
    import tiledsl.runtime.aux_args as aux_args
    made: dict = {}
    monkeypatch.setattr(aux_args, "geometric_slope_tensor",
                        lambda like, device_id, heads: made.setdefault(heads, device.tensor((heads,), "float32")))
    return made


def test_geometric_slopes_and_softcap_alone(device, monkeypatch):
    made = stub_geometric_slopes(device, monkeypatch)
    cu = device.index(CU)
    q, k, v = packed(device)
    tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, alibi_slopes="geometric")
    name, *_, values = device.last()
    assert "alibig" in name and values[-2] == made[HEADS].data_ptr() and int32_of(values[-1]) == 0
    tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, softcap=30.0)
    name, *_, values = device.last()
    assert "softcap30" in name and "sinks" not in name and "alibi" not in name


def test_the_host_path_takes_the_modifications_too(device):
    """Without max_seqlen (cu_seqlens read on the host) the call runs the same modified kernel."""
    cu = device.index(CU)
    q, k, v = packed(device)
    sinks = device.tensor((HEADS,), "float32")
    tiledsl.varlen_attention(q, k, v, cu, cu, sinks=sinks)
    name, *_, values = device.last()
    assert "sinks" in name and values[-1] == sinks.data_ptr()


@pytest.mark.parametrize("keywords, match", [
    (lambda d: dict(sinks=d.tensor((HEADS - 1,), "float32")), r"varlen_attention: sinks must be"),
    (lambda d: dict(alibi_slopes=d.tensor((2, HEADS), "float32")), r"varlen_attention: alibi_slopes must be"),
    (lambda d: dict(sinks=d.tensor((HEADS,), "float16")), r"sinks must be float32|sinks must be a float"),
    (lambda d: dict(softcap=-1.0), r"softcap must be a finite number > 0"),
    (lambda d: dict(score_mod="score + bias[h, q_idx]", aux={"bias": d.tensor((HEADS, 100), "float32")}),
     r"varlen_attention: score_mod reads bias\[h, q_idx\]: index 1 \(q_idx\) can reach 0\.\.\d+ for this "
     r"launch, outside bias.s 0\.\.99"),
    (lambda d: dict(mask_mod="keep[b] != 0", aux={"keep": d.tensor((2,), "int32")}),
     r"varlen_attention: mask_mod reads keep\[b\]: index 0 \(b\) can reach 0\.\.2 for this launch"),
])
def test_bad_or_unbuilt_modifications_are_refused_before_launch(device, keywords, match):
    cu = device.index(CU)
    q, k, v = packed(device)
    launches = len(device.launches)
    for bounds in ((250, 250), (None, None)):
        with pytest.raises(RuntimeInputError, match=match):
            tiledsl.varlen_attention(q, k, v, cu, cu, *bounds, **keywords(device))
    assert len(device.launches) == launches


def test_fp8_varlen_refuses_modifications(device):
    cu = device.index(CU)
    q, k, v = (device.tensor((TOTAL, h, 128), "float8_e4m3fn") for h in (HEADS, KV_HEADS, KV_HEADS))
    with pytest.raises(RuntimeInputError, match=r"FP8 \(float8_e4m3fn\) attention has no kernel with score"):
        tiledsl.varlen_attention(q, k, v, cu, cu, 250, 250, softcap=30.0)
    with pytest.raises(RuntimeInputError, match="FP8 .* no kernel with score modifications"):
        tiledsl.VarlenAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, dtype="float8_e4m3fn",
                                device="cuda", max_batch=4, sinks=True)


def test_planned_varlen_runs_take_each_layers_sinks(device, monkeypatch):
    made = stub_geometric_slopes(device, monkeypatch)
    varlen = tiledsl.VarlenAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, dtype="bfloat16",
                                     device=device.torch.device("cuda", 0), max_batch=4, causal=True, softcap=30.0,
                                     alibi_slopes="geometric", sinks=True)
    varlen.plan(np.array(CU, np.int32), np.array(CU, np.int32))
    q, k, v = packed(device)
    with pytest.raises(RuntimeInputError, match=r"reads sinks: pass run\(\.\.\., sinks=tensor\)"):
        varlen.run(q, k, v)
    for _ in range(2):
        layer_sinks = device.tensor((HEADS,), "float32")
        out = device.tensor((TOTAL, HEADS, 128))
        assert varlen.run(q, k, v, out=out, sinks=layer_sinks) is out
        name, *_, values = device.last()
        assert "softcap30" in name and "alibig" in name and values[-1] == layer_sinks.data_ptr()
        assert values[-3] == made[HEADS].data_ptr()
        assert out.data_ptr() in values
    with pytest.raises(RuntimeInputError, match="VarlenAttention.run: sinks must be"):
        varlen.run(q, k, v, sinks=device.tensor((HEADS + 1,), "float32"))
    plain = tiledsl.VarlenAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, dtype="bfloat16",
                                    device=device.torch.device("cuda", 0), max_batch=4)
    plain.plan(np.array(CU, np.int32), np.array(CU, np.int32))
    with pytest.raises(RuntimeInputError, match="sinks / alibi_slopes are for a wrapper made with them"):
        plain.run(q, k, v, sinks=device.tensor((HEADS,), "float32"))


def test_planned_varlen_per_sequence_slopes_follow_the_plans_batch(device):
    slopes = device.tensor((3, HEADS), "float32")
    varlen = tiledsl.VarlenAttention(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=128, dtype="bfloat16",
                                     device=device.torch.device("cuda", 0), max_batch=4, alibi_slopes=slopes)
    varlen.plan(np.array(CU, np.int32), np.array(CU, np.int32))
    q, k, v = packed(device)
    varlen.run(q, k, v)
    values = device.last()[-1]
    assert values[-2] == slopes.data_ptr() and int32_of(values[-1]) == HEADS
    varlen.plan(np.array([0, 351], np.int32), np.array([0, 351], np.int32))   # one sequence: (3, heads) no longer fits
    with pytest.raises(RuntimeInputError, match="alibi_slopes must be"):
        varlen.run(q, k, v)
