"""The Triton program of `decode_attention.decode_attention`: one (row, kv head, chunk) of a
decode step, which finishes the QKV projection, writes the new key/value and attends over its
share of the row's cache entries (the design is in `decode_attention`'s module docstring).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DOT_ROWS = 16  # the smallest M of a tensor-core tile


# long: one Triton program's helpers (projection, prepare, locate, load) close over its refs and indices.
def program(*refs, G, block_k, chunks, method, normalize, partials, bias, rope, norm, eps, dtype, page_size, length):
    """One (row, kv head, chunk) program.

    Refs, in order: qkv [G + 2, K] (G query rows, the new key, the new value; with
    ``partials`` P float32 partial sums [P, G + 2, K]), pos [], with ``page_size`` the
    row's page table [T], then with ``bias`` bias [G + 2, K], with ``rope`` rope_pos []
    and freq [K], with ``norm`` q_norm [K] and k_norm [K], then k/v (read), k/v (the same
    buffers, written) and the outputs. k/v are the row's [S, K] entries, or with
    ``page_size`` every page of this kv head [N, P, K], entry t at page table[t // P].
    """
    refs = list(refs)
    qkv_ref, pos_ref = refs.pop(0), refs.pop(0)
    table_ref = refs.pop(0) if page_size else None
    bias_ref = refs.pop(0) if bias else None
    rope_pos_ref, freq_ref = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    q_norm_ref, k_norm_ref = (refs.pop(0), refs.pop(0)) if norm else (None, None)
    k_ref, v_ref, k_out, v_out, *outs = refs
    S, K = length, k_ref.shape[-1]
    c = pl.program_id(2)
    pos = pos_ref[...]
    filled = jnp.minimum(pos, S)  # cache entries [0, filled) are read; pos is the new one
    # the row's own entries split evenly into ``chunks`` runs of whole blocks (ragged rows balance)
    chunk = pl.cdiv(pl.cdiv(filled, chunks), block_k) * block_k
    start = c * chunk
    end = jnp.minimum(start + chunk, filled)
    scale = 1.0 / math.sqrt(K)
    first = c == 0
    cols = jnp.arange(K)
    rotate = (cols + K // 2) % K  # rotate_half(x) = sign * x[rotate]

    def rounded(x):  # float32 holding a value of the model dtype
        return x.astype(dtype).astype(jnp.float32)

    if rope:
        angle = rope_pos_ref[...].astype(jnp.float32) * freq_ref[...]
        cos = rounded(jnp.cos(angle))[None, :]
        sin = rounded(jnp.sin(angle))
        sin = jnp.where(cols < K // 2, -sin, sin)[None, :]

    def projection(rows, valid, columns):
        """Rows ``[n, K]`` (columns permuted by ``columns``) of the QKV projection, float32."""
        if not partials:
            x = plgpu.load(qkv_ref.at[rows[:, None], columns[None, :]], mask=valid[:, None], other=0.0)
            x = x.astype(jnp.float32)
        else:  # finish the split-K matmul: sum the partials, round as the matmul's output
            x = sum(plgpu.load(qkv_ref.at[p, rows[:, None], columns[None, :]], mask=valid[:, None], other=0.0)
                    for p in range(partials))
            x = rounded(x)
        if bias:
            x = rounded(x + plgpu.load(bias_ref.at[rows[:, None], columns[None, :]], mask=valid[:, None],
                                       other=0.0).astype(jnp.float32))
        return x

    def prepare(rows, valid, process, weight_ref=None):
        """Rows ``[n, K]`` of the QKV projection as float32; with ``process``, QK-norm
        (``weight_ref``) then RoPE, rounded to the model dtype where the XLA path rounds."""
        x = projection(rows, valid, cols)
        if not process or not (rope or norm):
            return x
        x_rot = projection(rows, valid, rotate)
        if norm:
            r = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / K + eps)
            w = weight_ref[...].astype(jnp.float32)[None, :]
            w_rot = weight_ref[rotate].astype(jnp.float32)[None, :]
            x, x_rot = rounded(w * rounded(x * r)), rounded(w_rot * rounded(x_rot * r))
        if rope:
            x = rounded(x * cos + x_rot * sin)
        return x

    offsets = jnp.arange(block_k)
    num_blocks = jnp.maximum(pl.cdiv(end - start, block_k), 0)
    gather = page_size and block_k > page_size  # a block spans block_k / P pages
    neg = jnp.float32(-1e30)  # finite: exp(neg - m) underflows to 0 without inf - inf
    # A chunk past the end of its row's entries (a short row's upper chunks, an idle lane's)
    # reads nothing: it stores an empty partial (weight 0 in the combine) and skips the
    # projection, so an empty program costs little more than its launch.
    works = first | (num_blocks > 0)

    if not normalize:  # (one chunk: every program is its row's first)
        @pl.when(jnp.logical_not(works))
        def _empty():
            n = DOT_ROWS if method == "dot" else 1
            zero = jnp.zeros((n,), jnp.float32)
            for g in range(1 if method == "dot" else G):
                _store(outs, pl.ds(g, n), jnp.zeros((n, K), jnp.float32), zero + neg, zero, False,
                       mask=jnp.arange(n) < G if method == "dot" else None)

    @pl.when(works)
    def _attend():
        one = jnp.zeros((1,), jnp.int32)
        k_new = prepare(one + G, one == 0, True, k_norm_ref)  # [1, K]
        v_new = prepare(one + G + 1, one == 0, False)

        def entries(ref, index, size):  # ``size`` entries from cache index ``index`` (one page at most)
            if not page_size:
                return ref.at[pl.ds(index, size), :]
            return ref.at[table_ref[index // page_size], pl.ds(index % page_size, size), :]

        @pl.when(first & (pos < S))
        def _write():
            entries(k_out, pos, 1)[...] = k_new.astype(k_out.dtype)
            entries(v_out, pos, 1)[...] = v_new.astype(v_out.dtype)

        def locate(i):
            """Block i's entries: (where to read them, which are valid). A block inside one page is
            a slice of it; a block over several pages gathers each entry's page from the table once
            for both the key and the value load."""
            index = start + i * block_k + offsets
            valid = index < end
            if not gather:
                return start + i * block_k, valid
            pages = plgpu.load(table_ref.at[index // page_size], mask=valid, other=0)
            return (pages[:, None], (index % page_size)[:, None]), valid

        def load(ref, where, valid):
            source = ref.at[where[0], where[1], cols[None, :]] if gather else entries(ref, where, block_k)
            return plgpu.load(source, mask=valid[:, None], other=0.0)

        seed = jnp.maximum(1 - c, 0).astype(jnp.float32)  # 1 in chunk 0, else 0 (no bool -> float: Triton)
        if method == "vector":
            qs = [prepare(one + g, one == 0, True, q_norm_ref) * scale for g in range(G)]  # [1, K] each
            # seed with the new entry: m = its logit, denom = 1, o = its value (chunk 0 only)
            init = [(v_new * seed, jnp.where(first, jnp.sum(q * k_new), neg), seed) for q in qs]

            def body(i, carry):
                where, valid = locate(i)
                k, v = load(k_ref, where, valid).astype(jnp.float32), load(v_ref, where, valid).astype(jnp.float32)
                out = []
                for q, (o, m, denom) in zip(qs, carry, strict=True):
                    s = jnp.where(valid, jnp.sum(k * q, axis=1), neg)  # [block_k]
                    m_next = jnp.maximum(m, jnp.max(s))
                    p = jnp.exp(s - m_next)
                    correction = jnp.exp(m - m_next)
                    o = o * correction + jnp.sum(p[:, None] * v, axis=0)[None, :]
                    out.append((o, m_next, denom * correction + jnp.sum(p)))
                return tuple(out)

            final = lax.fori_loop(0, num_blocks, body, tuple(init))
            o = [o for o, _, _ in final]
            m = [m for _, m, _ in final]
            denom = [denom for _, _, denom in final]
            for g in range(G):
                _store(outs, pl.ds(g, 1), o[g], m[g], denom[g], normalize, mask=None)
        else:
            rows = jnp.arange(DOT_ROWS)
            q = prepare(rows, rows < G, True, q_norm_ref).astype(dtype)  # [16, K], rows >= G zero
            s_new = jnp.sum(q.astype(jnp.float32) * k_new, axis=1) * scale  # [16]
            m0 = jnp.where(first, s_new, neg)
            denom0 = jnp.zeros_like(s_new) + seed
            o0 = jnp.broadcast_to(v_new, (DOT_ROWS, K)) * seed

            def body(i, carry):
                o, m, denom = carry
                where, valid = locate(i)
                k = load(k_ref, where, valid)
                s = plgpu.dot(q, k.astype(dtype).T).astype(jnp.float32) * scale  # [16, block_k]
                s = jnp.where(valid[None, :], s, neg)
                m_next = jnp.maximum(m, jnp.max(s, axis=1))
                p = jnp.exp(s - m_next[:, None])
                correction = jnp.exp(m - m_next)
                v = load(v_ref, where, valid)
                o = o * correction[:, None] + plgpu.dot(p.astype(dtype), v.astype(dtype)).astype(jnp.float32)
                return o, m_next, denom * correction + jnp.sum(p, axis=1)

            o, m, denom = lax.fori_loop(0, num_blocks, body, (o0, m0, denom0))
            _store(outs, pl.ds(0, DOT_ROWS), o, m, denom, normalize, mask=rows < G)


def _store(outs, rows, o, m, denom, normalize, mask):
    """Write a program's rows: normalized output, or the float32 partials (o, m, denom) of its chunk."""
    o_ref = outs[0]
    o_mask = None if mask is None else mask[:, None]
    if normalize:
        denom = denom[:, None] if mask is not None else denom
        plgpu.store(o_ref.at[rows, :], (o / denom).astype(o_ref.dtype), mask=o_mask)
        return
    m_ref, denom_ref = outs[1:]
    plgpu.store(o_ref.at[rows, :], o, mask=o_mask)
    if mask is None:  # one row: scalars
        m, denom = jnp.zeros((1,), jnp.float32) + m, jnp.zeros((1,), jnp.float32) + denom
    plgpu.store(m_ref.at[rows], m, mask=mask)
    plgpu.store(denom_ref.at[rows], denom, mask=mask)
