"""The MoE over FP8, int8 and int4 slot buffers in two Triton launches: packed bytes read once, decoded in registers.

The same plan as kernels/mxfp4_moe.py (whose grouping it reuses): a `w13` launch per group of (token, k) pairs
that share a slot and a tile of I outputs (gate and up rows against the pairs' tokens, + biases, the
activation, stored per pair), a `w2` launch per group and a tile of H outputs (+ bias, x the routing weight),
then a fixed-order torch sum over k. Decode (<= GEMV_MAX_PAIRS pairs) is one GEMV per pair; prefill sorts the
pairs by slot on the device and runs tl.dot per group. One kernel source, the format a compile-time constant:

* fp8 (Qwen3-*-FP8, DeepSeek-V3): e4m3 bytes [rows, in] (passed as uint8) and fp32 block scales
  [ceil(rows/b0), ceil(in/b1)]; w13's gate and up halves keep their own blocking. The e4m3 byte is decoded
  with integer ops (exact, no fp8 type needed: sm_80 and the interpreter run it too), times its block scale.
* int8: int8 [rows, in] and an fp32 scale per output row, applied once to the row's sum.
* int4: bytes [rows, in/2] (low nibble the even element, code = q + 8) and fp16 group scales [rows, in/group],
  widened to fp32 after the load (exact: the product is weight()'s).

Bytes per Qwen3-30B-A3B decode step and layer (8 experts): bf16 75.5 MB, fp8 37.8, int8 37.9, int4 21.2 (codes
+ fp16 scales; 23.6 with fp32 scales); `bench/gpu_check.sh` runs the `gpu` tests and `bench/quantized_experts.py --device cuda` the rates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mxfp4_moe import INTERPRET, plan_groups, sum_pairs

# T = tokens, K = top-k, P = computed (t, k) pairs, C = slots, H = hidden, I = intermediate, NB = groups,
# N = outputs of a projection, KB = bytes in one packed row

FP8, INT8, INT4 = 0, 1, 2
FORMAT_IDS = {"fp8": FP8, "int8": INT8, "int4": INT4}


@triton.jit
def _e4m3(code):
    """float8_e4m3fn bytes (int32, 0..255) -> fp32 x 2^-8, exactly (the NaN pattern, refused at load, reads as
    480 x 2^-8): the byte's exponent and mantissa placed at fp16's lowest exponent bits and top mantissa bits
    (e = 0 is then fp16's subnormal, no branch), its sign at bit 15, widened to fp32 (exact). Three integer ops
    and a conversion a byte, where a branch on the subnormals took eight."""
    bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot(x_ptr, x_rows, x_ok, stride_x, w_ptr, s_ptr, w_rows, s_rows, w_ok, KB, S_COLS, S_DIV: tl.constexpr,
         FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
         USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr):
    """x[x_rows] [BLOCK_M, in] @ W[w_rows]^T -> [BLOCK_M, BLOCK_N] fp32 (int8: before the row scale).

    W is one slot's packed rows (w_ptr [rows, KB] bytes); s_rows are the rows of its scales (s_ptr [., S_COLS],
    one column per S_DIV elements along the input; unused for int8). int4 bytes hold elements 2i and 2i + 1, so
    x is read as its even and odd elements; fp8 and int8 bytes are one element each."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the GEMV sums products elementwise across the K loop and reduces across threads once, at the end
    acc_e = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KB), dtype=tl.float32)  # unused (and dropped) with tl.dot
    for k0 in range(0, KB, BLOCK_KB):
        kk = k0 + tl.arange(0, BLOCK_KB)  # [BKB] bytes along the row
        k_ok = kk < KB
        w_mask = w_ok[:, None] & k_ok[None, :]
        x_mask = x_ok[:, None] & k_ok[None, :]
        if FMT == 2:  # int4: two elements a byte
            codes = tl.load(w_ptr + w_rows[:, None] * KB + kk[None, :], mask=w_mask, other=0x88).to(tl.int32)
            scale = tl.load(s_ptr + s_rows[:, None] * S_COLS + ((2 * kk) // S_DIV)[None, :], mask=w_mask,
                            other=0.0).to(tl.float32)  # fp16 -> fp32, exact
            w_lo = ((codes & 15) - 8).to(tl.float32) * scale  # [BN, BKB] elements 2i
            w_hi = ((codes >> 4) - 8).to(tl.float32) * scale  # [BN, BKB] elements 2i + 1
            x_at = x_ptr + x_rows[:, None] * stride_x + 2 * kk[None, :]
            # upcast right after the load: the interpreter's bf16 arithmetic is not IEEE's
            x_lo = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)  # [BM, BKB]
            x_hi = tl.load(x_at + 1, mask=x_mask, other=0.0).to(tl.float32)  # [BM, BKB]
            if USE_DOT:
                if DOT_BF16:  # weights rounded to bf16, as the torch path rounds them for a bf16 model
                    acc = tl.dot(x_lo.to(tl.bfloat16), tl.trans(w_lo.to(tl.bfloat16)), acc)
                    acc = tl.dot(x_hi.to(tl.bfloat16), tl.trans(w_hi.to(tl.bfloat16)), acc)
                else:
                    acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision="ieee")
                    acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision="ieee")
            else:
                acc_e += x_lo[:, None, :] * w_lo[None, :, :] + x_hi[:, None, :] * w_hi[None, :, :]
        else:
            if FMT == 1:  # int8: the codes themselves (the row scale comes after the sum)
                w = tl.load(w_ptr + w_rows[:, None] * KB + kk[None, :], mask=w_mask, other=0).to(tl.float32)
            else:  # fp8: e4m3 x its block's scale
                codes = tl.load(w_ptr + w_rows[:, None] * KB + kk[None, :], mask=w_mask, other=0).to(tl.int32)
                scale = tl.load(s_ptr + s_rows[:, None] * S_COLS + (kk // S_DIV)[None, :], mask=w_mask, other=0.0)
                w = _e4m3(codes) * scale  # [BN, BKB] x 2^-8
            xv = tl.load(x_ptr + x_rows[:, None] * stride_x + kk[None, :], mask=x_mask, other=0.0).to(tl.float32)
            if USE_DOT:
                if DOT_BF16:  # int8 codes are exact in bf16; fp8 weights x scale rounded as the torch path does
                    acc = tl.dot(xv.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
                else:
                    acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
            else:
                acc_e += xv[:, None, :] * w[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc_e, axis=2)
    if FMT == 1:
        acc = acc * tl.load(s_ptr + s_rows, mask=w_ok, other=0.0)[None, :]
    if FMT == 0:
        acc = acc * 256.0  # the codes' 2^-8 (a power of two: the sum rounds as the true weights' would)
    return acc


@triton.jit
def _scale_rows(rows, SPLIT, SPLIT_AT, B0):
    """The scale rows of weight rows: fp8 blocks b0 rows, and w13's up half (rows >= SPLIT) starts its own
    blocking at scale row SPLIT_AT; the int formats pass B0 = 1, SPLIT_AT = SPLIT (one scale row per row)."""
    return tl.where(rows < SPLIT, rows // B0, SPLIT_AT + (rows - SPLIT) // B0)


@triton.jit
def _w13_kernel(x_ptr, stride_x, w_ptr0, s_ptr0, bias_ptr, group_slot_ptr, group_pairs_ptr, act_ptr,
                stride_act, N, KB, TOPK, limit, alpha, stride_wc, stride_sc, stride_biasc, S_COLS,
                S_DIV: tl.constexpr, SPLIT_AT, B0, FMT: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_KB: tl.constexpr):
    """act[pair, j] = activation(gate_j, up_j) for the group's pairs and a tile of j in [0, I) (N = I)."""
    slot = tl.load(group_slot_ptr + tl.program_id(0))
    if slot >= 0:
        pairs = tl.load(group_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM], -1 = padding
        ok = pairs >= 0
        tokens = tl.where(ok, pairs // TOPK, 0)
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        j_ok = j < N
        if CLAMPED:  # GPT-OSS: rows interleaved, even gate, odd up
            gate_rows = 2 * j
            up_rows = 2 * j + 1
        else:  # gate rows, then up rows
            gate_rows = j
            up_rows = j + N
        slot64 = slot.to(tl.int64)  # a pool of slots can pass 2^31 bytes
        w_ptr = w_ptr0 + slot64 * stride_wc
        s_ptr = s_ptr0 + slot64 * stride_sc
        gate = _dot(x_ptr, tokens, ok, stride_x, w_ptr, s_ptr, gate_rows, _scale_rows(gate_rows, N, SPLIT_AT, B0),
                    j_ok, KB, S_COLS, S_DIV, FMT, BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
        up = _dot(x_ptr, tokens, ok, stride_x, w_ptr, s_ptr, up_rows, _scale_rows(up_rows, N, SPLIT_AT, B0),
                  j_ok, KB, S_COLS, S_DIV, FMT, BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
        if HAS_BIAS:
            b_ptr = bias_ptr + slot64 * stride_biasc
            gate += tl.load(b_ptr + gate_rows, mask=j_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + up_rows, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        if CLAMPED:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            a = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:
            a = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + pairs[:, None] * stride_act + j[None, :], a.to(act_ptr.dtype.element_ty),
                 mask=ok[:, None] & j_ok[None, :])


@triton.jit
def _w2_kernel(act_ptr, stride_act, w_ptr0, s_ptr0, bias_ptr, weights_ptr, group_slot_ptr, group_pairs_ptr,
               y_ptr, stride_y, N, KB, stride_wc, stride_sc, stride_biasc, S_COLS, S_DIV: tl.constexpr, B0,
               FMT: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_BF16: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
    """y[pair, j] = (down_j . act[pair] + bias_j) * topk_weight[pair] for a tile of j in [0, H) (N = H)."""
    slot = tl.load(group_slot_ptr + tl.program_id(0))
    if slot >= 0:
        pairs = tl.load(group_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        ok = pairs >= 0
        rows = tl.where(ok, pairs, 0)
        j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        j_ok = j < N
        slot64 = slot.to(tl.int64)
        acc = _dot(act_ptr, rows, ok, stride_act, w_ptr0 + slot64 * stride_wc, s_ptr0 + slot64 * stride_sc, j,
                   j // B0, j_ok, KB, S_COLS, S_DIV, FMT, BLOCK_M, BLOCK_N, BLOCK_KB, USE_DOT, DOT_BF16)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + slot64 * stride_biasc + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(weights_ptr + rows, mask=ok, other=0.0).to(tl.float32)  # [BM]
        tl.store(y_ptr + pairs[:, None] * stride_y + j[None, :], acc * weight[:, None],
                 mask=ok[:, None] & j_ok[None, :])


def _configs(use_dot: bool) -> list[triton.Config]:
    if INTERPRET:  # one config, big tiles: the interpreter runs a program in numpy
        return [triton.Config({"BLOCK_N": 32, "BLOCK_KB": 32}, num_warps=4)]
    # few configs, so the first call of each shape compiles in seconds; GEMV tiles give a thread 16-32 code bytes
    # (16-byte loads; bench/kernel_sass.py reports the first), <= 168 registers on sm_90, no spills
    if use_dot:
        return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st)
                for n, kb, w, st in [(64, 32, 8, 3), (128, 32, 8, 3)]]
    return [triton.Config({"BLOCK_N": n, "BLOCK_KB": kb}, num_warps=w, num_stages=st)
            for n, kb, w, st in [(16, 256, 4, 2), (8, 256, 4, 2), (8, 512, 8, 2)]]


_KEY = ["N", "KB", "BLOCK_M", "FMT"]
_W13 = {d: triton.autotune(_configs(d), key=_KEY)(_w13_kernel) for d in (False, True)}
_W2 = {d: triton.autotune(_configs(d), key=_KEY)(_w2_kernel) for d in (False, True)}


def decode_constexprs(fmt: str, block: tuple[int, int] | None = None, group: int = 32) -> dict[str, int]:
    """The compile-time scale blocking of a format: S_DIV elements along the input share a scale (FP8: the block's
    b1; int4: the group; int8: 1, unused), so the scale column is a shift, not a division per element."""
    return {"S_DIV": block[1] if fmt == "fp8" else group if fmt == "int4" else 1}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quant_moe(hidden_states: torch.Tensor, topk_weights: torch.Tensor, slot_ids: torch.Tensor, tensors, act,
              fmt: str, block: tuple[int, int] | None = None, residual: torch.Tensor | None = None,
              pairs: torch.Tensor | None = None, mode: str | None = None) -> torch.Tensor:
    """[residual +] sum_k topk_weights[t, k] * Expert_{slot_ids[t, k]}(hidden_states[t]) -> [T, H], input dtype.

    hidden_states [T, H], topk_weights [T, K], slot_ids [T, K]; tensors: the slot buffers by name, for fmt
    "fp8" w13 [C, 2I, H] e4m3 + w13_scale [C, 2 ceil(I/b0), ceil(H/b1)], w2 [C, H, I] + w2_scale (block = (b0, b1));
    "int8" w13_q [C, 2I, H] int8 + w13_scale [C, 2I], w2_q + w2_scale [C, H]; "int4" w13_q [C, 2I, H/2] uint8 +
    w13_scale [C, 2I, H/g] fp16, w2_q [C, H, I/2] + w2_scale [C, H, I/g]; optional w13_bias [C, 2I] / w2_bias [C, H].
    act: an ExpertActivation (`swiglu`: gate rows then up rows; `clamped_swiglu`: interleaved). pairs [P]: flat
    (t, k) indices to compute (None: all). mode: "gemv" or "grouped" (None: by the number of pairs).
    """
    T, H = hidden_states.shape
    K = slot_ids.shape[1]
    fid = FORMAT_IDS[fmt]
    wname = "" if fid == FP8 else "_q"
    w13, s13, w2, s2 = (tensors[n] for n in (f"w13{wname}", "w13_scale", f"w2{wname}", "w2_scale"))
    if fid == FP8:  # the e4m3 bytes as bytes: decoded by the kernel
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
    C, I2 = w13.shape[0], w13.shape[1]
    I = I2 // 2
    per_byte = 2 if fid == INT4 else 1
    if w13.shape[2] * per_byte != H or w2.shape[1] != H or w2.shape[2] * per_byte != I:
        raise ValueError(f"{fmt} slot buffers {list(w13.shape)} / {list(w2.shape)} do not fit H = {H}")
    for t in (w13, s13, w2, s2):
        if not t.is_contiguous():
            raise ValueError(f"{fmt} slot buffers must be contiguous")
    if act.kind not in ("swiglu", "clamped_swiglu"):
        raise ValueError(f"activation {act.kind!r} has no fused {fmt} kernel")
    # scale layout: (columns, elements per column) of w13's and w2's scales; the row blocking (b0) and where
    # w13's up half starts its scale rows
    if fid == FP8:
        b0, b1 = block
        cols13, div13, cols2, div2, B0, split_at = s13.shape[2], b1, s2.shape[2], b1, b0, _cdiv(I, b0)
    elif fid == INT4:
        cols13, div13, cols2, div2, B0, split_at = s13.shape[2], H // s13.shape[2], s2.shape[2], I // s2.shape[2], 1, I
    else:
        cols13 = div13 = cols2 = div2 = B0 = 1
        split_at = I
    x = hidden_states.contiguous()
    g = plan_groups(x, topk_weights, slot_ids, pairs, C, I, H, mode)
    if g.count:
        b13, b2 = tensors.get("w13_bias"), tensors.get("w2_bias")
        nb = g.groups
        _W13[g.use_dot][lambda meta: (nb, triton.cdiv(I, meta["BLOCK_N"]))](
            x, x.stride(0), w13, s13, b13 if b13 is not None else s13, g.group_slot, g.group_pairs, g.act_buf,
            g.act_buf.stride(0), I, w13.shape[2], K, float(act.limit), float(act.alpha), w13.stride(0), s13.stride(0),
            b13.stride(0) if b13 is not None else 0, cols13, div13, split_at, B0, FMT=fid, HAS_BIAS=b13 is not None,
            CLAMPED=act.kind == "clamped_swiglu", USE_DOT=g.use_dot, DOT_BF16=g.dot_bf16, BLOCK_M=g.block_m)
        _W2[g.use_dot][lambda meta: (nb, triton.cdiv(H, meta["BLOCK_N"]))](
            g.act_buf, g.act_buf.stride(0), w2, s2, b2 if b2 is not None else s2, g.weights, g.group_slot,
            g.group_pairs, g.y, g.y.stride(0), H, w2.shape[2], w2.stride(0), s2.stride(0),
            b2.stride(0) if b2 is not None else 0, cols2, div2, B0, FMT=fid, HAS_BIAS=b2 is not None,
            USE_DOT=g.use_dot, DOT_BF16=g.dot_bf16, BLOCK_M=g.block_m)
    return sum_pairs(g.y, T, K, residual, hidden_states.dtype)
