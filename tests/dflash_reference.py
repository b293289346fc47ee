"""The independent reference of the DFlash draft model, for specjax's parity tests (docs/dflash.md).

Plain PyTorch, float32, written from the definition in docs/dflash.md and not from specjax's code: it reads the
published checkpoint layout (a dict of tensor name -> tensor, names as in the safetensors file, with or without a
leading "model.") and the checkpoint's config.json as a dict. The draft owns no embedding and no LM head: the caller
passes the target's embedding matrix [V, D] and LM head [V, D] (logits = h @ lm_head.T; a tied target passes its
embedding twice).

- `block_forward`: one drafting block, as at inference. The context is C target feature rows (the concatenated
  target layer outputs, [B, C, n*D]) at given positions; the block is B_s token ids (the anchor, then mask tokens) at
  positions start .. start+B_s-1. Every block row attends to every valid context row and every block row
  (no causal mask). Returns the block's logits [B, B_s, V] and final hidden states [B, B_s, D]; row j >= 1 predicts
  the token at position start+j, row 0 (the anchor) is unused.
- `packed_forward`: the training layout, many blocks of one sequence in one pass under the training mask (a block
  anchored at a sees context positions < a and its own block only). Each block equals `block_forward` with the
  context cut at its anchor; the smoke below checks exactly that.
- `default_target_layer_ids`, `context_features`, `loss_weights`: the small helpers of the definition.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers (0-based, "output of layer i") read by a draft with `num_draft_layers` layers and no explicit
    `target_layer_ids`: the middle layer for one draft layer, else evenly spread from 1 to N-3 (Python's round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def context_features(hf_hidden_states, layer_ids) -> torch.Tensor:
    """Concatenate the outputs of the given target layers from HF's `output_hidden_states` tuple (entry 0 is the
    embedding output, entry i+1 the output of layer i): [B, T, len(layer_ids) * D], lowest id first."""
    return torch.cat([hf_hidden_states[i + 1] for i in layer_ids], dim=-1)


def loss_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """Per-row loss weight of a block [block_size]: 0 for the anchor row, exp(-(k-1)/gamma) for row k >= 1 (1 when
    gamma is None or <= 0)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma) if gamma else torch.ones(block_size)
    return torch.where(k == 0, torch.zeros(()), w)


def _cfg(config: dict, key: str, default=None):
    """A DFlash key: inside `dflash_config` first, then top level."""
    inner = config.get("dflash_config") or {}
    return inner.get(key, config.get(key, default))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    theta = float(config.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":  # Llama-3.1's frequency-dependent scaling
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen > old / lo, inv / factor, torch.where(wavelen < old / hi, inv, mid))
    raise NotImplementedError(f"rope_scaling type {kind!r}")


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd] rotated at positions pos [B, T] (rotate-half pairing: i with i + hd/2)."""
    ang = pos.to(torch.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, :, None], torch.cat([ang, ang], -1).sin()[:, :, None]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _forward(w, config, embed, lm_head, feats, ctx_pos, ids, pos, allow):
    """The draft over query rows `ids` [B, T] at `pos` [B, T] with context feature rows `feats` [B, C, n*D] at
    `ctx_pos` [B, C]; allow [B, T, C + T] says which keys (context rows, then query rows) each query row sees."""
    w = {k[len("model.") :] if k.startswith("model.") else k: v.to(torch.float32) for k, v in w.items()}
    eps = float(config.get("rms_norm_eps", 1e-6))
    nh, nkv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    hd = config.get("head_dim") or config["hidden_size"] // nh
    inv = _inv_freq(config, hd)
    b, t = ids.shape

    ctx = _rms(feats.to(torch.float32) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [B, C, D]
    h = embed.to(torch.float32)[ids]  # [B, T, D]
    bias = torch.zeros(allow.shape, dtype=torch.float32).masked_fill(~allow, float("-inf"))[:, None]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."

        def lin(x, name, p=p):
            y = x @ w[p + name + ".weight"].T
            return y + w[p + name + ".bias"] if p + name + ".bias" in w else y

        x = _rms(h, w[p + "input_layernorm.weight"], eps)  # the context rows get no input_layernorm
        q = _rms(lin(x, "self_attn.q_proj").view(b, t, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        kin = torch.cat([ctx, x], 1)  # keys/values: context rows first, then the block rows
        k = _rms(lin(kin, "self_attn.k_proj").view(b, -1, nkv, hd), w[p + "self_attn.k_norm.weight"], eps)
        v = lin(kin, "self_attn.v_proj").view(b, -1, nkv, hd)
        q, k = _rope(q, pos, inv), _rope(k, torch.cat([ctx_pos, pos], 1), inv)
        k, v = k.repeat_interleave(nh // nkv, 2), v.repeat_interleave(nh // nkv, 2)  # query head j uses kv head j // g
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd) + bias
        a = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(b, t, nh * hd)
        h = h + lin(a, "self_attn.o_proj")
        y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + lin(F.silu(lin(y, "mlp.gate_proj")) * lin(y, "mlp.up_proj"), "mlp.down_proj")
    h = _rms(h, w["norm.weight"], eps)
    return h @ lm_head.to(torch.float32).T, h


def block_forward(weights, config, embed, lm_head, target_feats, ctx_positions, block_ids, block_start, ctx_valid=None):
    """One inference block. target_feats [B, C, n*D]; ctx_positions [B, C] or [C]; block_ids [B, Bs] (anchor, then
    mask ids); block_start an int or [B]; ctx_valid [B, C] bool (False rows are padding, default all valid).
    Returns (logits [B, Bs, V], hidden [B, Bs, D])."""
    b, c = target_feats.shape[:2]
    bs = block_ids.shape[1]
    ctx_positions = torch.as_tensor(ctx_positions).expand(b, c)
    start = torch.as_tensor(block_start).reshape(-1, 1).expand(b, 1)
    pos = start + torch.arange(bs)
    valid = torch.ones(b, c, dtype=torch.bool) if ctx_valid is None else ctx_valid
    allow = torch.cat([valid[:, None, :].expand(b, bs, c), torch.ones(b, bs, bs, dtype=torch.bool)], -1)
    return _forward(weights, config, embed, lm_head, target_feats, ctx_positions, block_ids, pos, allow)


def packed_forward(weights, config, embed, lm_head, target_feats, input_ids, anchors):
    """The training pass: target_feats [B, S, n*D] for positions 0..S-1 of input_ids [B, S]; anchors [B, N] (each
    anchor a + block_size - 1 may run past S: its rows are still computed). Block n is [input_ids[a], mask, ...] at
    positions a .. a+Bs-1 and sees context rows < a and its own block. Returns logits [B, N, Bs, V]."""
    bs, mask_id = config["block_size"], _cfg(config, "mask_token_id")
    b, s = input_ids.shape
    n = anchors.shape[1]
    ids = torch.full((b, n, bs), mask_id, dtype=torch.long)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    pos = anchors[:, :, None] + torch.arange(bs)  # [B, N, Bs]
    qa = anchors[:, :, None].expand(b, n, bs).reshape(b, n * bs)  # each query row's anchor
    ctx_ok = torch.arange(s)[None, None, :] < qa[:, :, None]  # [B, N*Bs, S]
    qb = torch.arange(n * bs) // bs
    own = (qb[:, None] == qb[None, :]).expand(b, n * bs, n * bs)
    allow = torch.cat([ctx_ok, own], -1)
    logits, _ = _forward(
        weights,
        config,
        embed,
        lm_head,
        target_feats,
        torch.arange(s).expand(b, s),
        ids.reshape(b, n * bs),
        pos.reshape(b, n * bs),
        allow,
    )
    return logits.view(b, n, bs, -1)


if __name__ == "__main__":
    torch.manual_seed(0)
    D, V, L, NH, NKV, HD, FF, BS, NT = 16, 40, 2, 4, 2, 8, 24, 4, 6
    ids_t = default_target_layer_ids(NT, L)
    cfg = {
        "hidden_size": D,
        "num_hidden_layers": L,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": HD,
        "intermediate_size": FF,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "block_size": BS,
        "num_target_layers": NT,
        "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": ids_t},
    }
    shapes = {"fc.weight": (D, len(ids_t) * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(L):
        shapes.update(
            {
                f"layers.{i}.{k}": v
                for k, v in {
                    "input_layernorm.weight": (D,),
                    "post_attention_layernorm.weight": (D,),
                    "self_attn.q_proj.weight": (NH * HD, D),
                    "self_attn.k_proj.weight": (NKV * HD, D),
                    "self_attn.v_proj.weight": (NKV * HD, D),
                    "self_attn.o_proj.weight": (D, NH * HD),
                    "self_attn.q_norm.weight": (HD,),
                    "self_attn.k_norm.weight": (HD,),
                    "mlp.gate_proj.weight": (FF, D),
                    "mlp.up_proj.weight": (FF, D),
                    "mlp.down_proj.weight": (D, FF),
                }.items()
            }
        )
    wts = {k: (1 + 0.1 * torch.randn(s)) if len(s) == 1 else 0.3 * torch.randn(s) for k, s in shapes.items()}
    embed, head = torch.randn(V, D), torch.randn(V, D)
    B, S = 2, 12
    toks = torch.randint(0, V - 1, (B, S))
    feats = torch.randn(B, S, len(ids_t) * D)
    anchors = torch.tensor([[2, 5, 9], [3, 4, 10]])

    packed = packed_forward(wts, cfg, embed, head, feats, toks, anchors)
    assert packed.shape == (B, 3, BS, V) and torch.isfinite(packed).all()
    for bi in range(B):  # each packed block equals the inference block with the context cut at its anchor
        for ni, a in enumerate(anchors[bi].tolist()):
            blk = torch.full((1, BS), V - 1)
            blk[0, 0] = toks[bi, a]
            ref, _ = block_forward(wts, cfg, embed, head, feats[bi : bi + 1, :a], torch.arange(a), blk, a)
            assert torch.allclose(ref[0], packed[bi, ni], atol=1e-4), (bi, ni)
    # padding context rows change nothing; later block rows do reach earlier ones (bidirectional block)
    blk = torch.cat([toks[:, 4:5], torch.full((B, BS - 1), V - 1)], 1)
    base, _ = block_forward(wts, cfg, embed, head, feats[:, :4], torch.arange(4), blk, 4)
    padded, _ = block_forward(
        wts,
        cfg,
        embed,
        head,
        torch.cat([feats[:, :4], feats[:, :2]], 1),
        torch.arange(6),
        blk,
        4,
        ctx_valid=torch.arange(6).expand(B, 6) < 4,
    )
    assert torch.allclose(base, padded, atol=1e-5)
    blk2 = blk.clone()
    blk2[:, -1] = 0
    changed, _ = block_forward(wts, cfg, embed, head, feats[:, :4], torch.arange(4), blk2, 4)
    assert not torch.allclose(changed[:, 1], base[:, 1])
    assert loss_weights(BS, 7.0)[0] == 0 and loss_weights(BS, 7.0)[1] == 1
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 10) == [1, 8, 14, 21, 28, 34, 41, 48, 54, 61]
    print("dflash_reference smoke: ok", tuple(packed.shape))
