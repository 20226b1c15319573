"""The words the front end answers with: an example of every setting and statement (the hint under an error),
and the closest known word to a misspelt one."""
from __future__ import annotations

import difflib

EXAMPLES = {
    "head_dim": "head_dim = 128", "head_dim_v": "head_dim_v = 64",
    "dtype": "dtype = bf16   (fp16, fp32; e4m3: FP8 Q, K, V in the hopper family)",
    "mask": "mask = causal   (none | causal | window(left = 256, right = 0); & document, prefix(N), blocks(q = 128, "
            "kv = 128))",
    "scale": "scale = 0.125", "queries": "queries = 1",
    "kv_cache": "kv_cache = paged(page = 16)   (or: contiguous, the default)",
    "layout": "layout = varlen   (or: batched, the default)",
    "kv_dtype": "kv_dtype = e4m3   (FP8 KV cache, decode only; default: the spec's dtype)",
    "kv_scale": "kv_scale = per_head   (or: per_tensor; with kv_dtype = e4m3)",
    "out_dtype": "out_dtype = bf16   (or: fp16; the output of dtype = e4m3)",
    "descale": "descale = per_head   (or: per_tensor, per_block; float32 descales of dtype = e4m3)",
    "order": "order q, kv   (or: kv, q)", "tile": "tile q = 128, kv = 64", "warps": "warps 4 along q",
    "pipeline": "pipeline 2 stages via cp.async", "warpgroups": "warpgroups producer 1 regs 24, consumer 2 regs 240",
    "overlap": "overlap pingpong, intra", "split": "split kv = 8   (or: kv = auto)",
    "mma": "mma wgmma   (or: mma.sync, the default)",
    "dequant": "dequant fragments   (or: shared, the default; with kv_dtype = e4m3)",
    "launch": "launch dynamic order longest_first   (launch: grid | persistent | dynamic; order: longest_first | "
              "pair_by_pair)",
    "schedule": "schedule {", "attention": "attention NAME {",
    "backward": "backward {", "dq": "dq accumulate atomic   (or: separate, ordered)",
    # score and mask modifications (frontend/check_mods.py)
    "softcap": "softcap = 30   (scores become 30 * tanh(score / 30); `softcap = 30 via fma` picks how tanh runs: "
               "ex2 | fma | split | tanh_approx)",
    "alibi": "alibi = geometric   (or: slopes, read from the aux tensor alibi_slopes)",
    "sinks": "sinks = per_head   (a learned logit per head joins the softmax: the aux tensor sinks)",
    "dropout": "dropout = 0.1   (the probability of dropping a weight)",
    "score_mod": "score_mod = score + bias[h, q_idx - kv_idx]",
    "mask_mod": "mask_mod = kv_idx <= q_idx | kv_idx == 0",
}


def did_you_mean(word: str, candidates) -> str:
    """"; did you mean 'tile'?" for the closest candidate, or "" when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""
