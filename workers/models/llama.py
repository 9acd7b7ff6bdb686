"""tokenline's forward pass for Llama-shaped models (transformers' LlamaForCausalLM), on the batch's cache.

The same computation as transformers' Llama forward with its SDPA attention, as one short run of torch
operations per layer: the query, key and value projections are one matmul over their weights laid side
by side, and so are the MLP's gate and up projections (the transformers modules' weights become views of
these, so the model is not held twice and stays usable as it was). A decode step writes each layer's new
keys and values in place into the batch's buffers (`SlabLayer.update`) and attends over them with a
grouped matmul (each key/value head serves its group of query heads without being copied out); a
prefill attends with SDPA under a causal mask joined with the left padding.

Tested against transformers' forward for the same inputs (tests/test_llama_forward.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.engine.kv_cache import KVBatch, SlabLayer

STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq fixed at load: computed once by transformers


class _Projection:
    """Linear layers laid side by side as one weight [in, out] (transposed: on the CPU a matmul with the
    weight in this layout took 0.55-0.75 of the time of transformers' `F.linear` at 1 to 31 rows), and
    their biases, if any. The layers' own weights and biases become views of these."""

    def __init__(self, *linears: torch.nn.Linear) -> None:
        with torch.no_grad():
            self.weight = torch.cat([linear.weight.t() for linear in linears], dim=1).contiguous()
            self.bias = None
            if any(linear.bias is not None for linear in linears):
                self.bias = torch.cat(
                    [
                        linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.weight.shape[0])
                        for linear in linears
                    ]
                )
        start = 0
        for linear in linears:
            end = start + linear.weight.shape[0]
            linear.weight = torch.nn.Parameter(self.weight[:, start:end].t(), requires_grad=False)
            if self.bias is not None:
                linear.bias = torch.nn.Parameter(self.bias[start:end], requires_grad=False)
            start = end

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(x, self.weight)
        return out if self.bias is None else out + self.bias


class _Layer:
    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _Projection(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = _Projection(attn.o_proj)
        self.gate_up = _Projection(mlp.gate_proj, mlp.up_proj)
        self.down = _Projection(mlp.down_proj)
        self.input_norm = layer.input_layernorm.weight
        self.post_attention_norm = layer.post_attention_layernorm.weight


class LlamaForward:
    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.group = self.heads // self.kv_heads  # query heads per key/value head
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        inner = model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        tied = model.lm_head.weight is inner.embed_tokens.weight
        # Tied to the embeddings (which must keep their rows): not laid out again, as that would hold it twice.
        self.lm_head = (lambda x: F.linear(x, self.embed)) if tied else _Projection(model.lm_head)
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.rope_scale = float(rotary.attention_scaling)

    @staticmethod
    def unsupported(model: torch.nn.Module) -> str | None:
        """Why this forward cannot stand in for the model's own, or None when it can."""
        config = model.config
        if type(model).__name__ != "LlamaForCausalLM":
            return f"{type(model).__name__} is not LlamaForCausalLM"
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in STATIC_ROPE_TYPES:
            return f"rope_type {rope!r}"
        if config.hidden_act != "silu":
            return f"hidden_act {config.hidden_act!r}"
        if getattr(config, "pretraining_tp", 1) != 1:
            return "pretraining_tp > 1"
        if config._attn_implementation not in ("sdpa", "eager"):
            return f"attention {config._attn_implementation!r}"
        return None

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        variance = x.float().pow(2).mean(-1, keepdim=True)  # as transformers: in float32, then back
        return weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rows, 1, tokens, head_dim] for these positions [rows, tokens]."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [rows, heads, tokens, dim], keys and values [rows, kv heads, tokens, dim], rotated."""
        return self._heads(layer.qkv(x), cos, sin)

    def _heads(
        self, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused QKV projection [rows, tokens, (heads + 2 kv heads) * dim] as rotated queries, keys, values."""
        rows, tokens = projected.shape[:2]
        heads = projected.view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        rotated = self._rotate(heads[:, : self.heads + self.kv_heads], cos, sin)
        return rotated[:, : self.heads], rotated[:, self.heads :], heads[:, self.heads + self.kv_heads :]

    def _prefill_mask(self, mask: torch.Tensor) -> torch.Tensor | None:
        """Which key each prompt query attends to [rows, 1, tokens, tokens]: causal, real keys only.
        A padding position attends to itself: a query with nothing to attend to gives NaN, and the
        padding's keys and values, though masked out everywhere, are kept in the cache. None for a
        single prompt, which has no padding: SDPA's own causal masking gives the same numbers, without
        building a mask (0.1 ms of a 31-token prefill's 2.6-3.3 ms on the 2-core CPU)."""
        rows, tokens = mask.shape
        if rows == 1:
            return None
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=mask.device).tril()
        allowed = (causal & mask.bool()[:, None, :]) | torch.eye(tokens, dtype=torch.bool, device=mask.device)
        return allowed.unsqueeze(1)

    def _prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """[rows, tokens, heads * dim]"""
        rows, tokens = q.shape[0], q.shape[2]
        attended = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(self.group, dim=1),
            v.repeat_interleave(self.group, dim=1),
            attn_mask=allowed,
            is_causal=allowed is None,
            scale=self.scale,
        )
        return attended.transpose(1, 2).reshape(rows, tokens, -1)

    def _decode_padding(self, kv: KVBatch) -> torch.Tensor:
        """Added to the scores: 0 where a row has a real position, the dtype's lowest value at its padding."""
        assert kv.mask is not None
        padding = (1 - kv.mask).to(self.dtype).mul_(torch.finfo(self.dtype).min)
        return padding.view(kv.mask.shape[0], 1, 1, -1)

    def _decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slab: SlabLayer, padding: torch.Tensor
    ) -> torch.Tensor:
        """[rows, 1, heads * dim]; the new column of keys and values is written into the slab in place."""
        rows = q.shape[0]
        keys, values = slab.update(k, v)  # [rows, kv heads, length, dim]
        queries = (q * self.scale).reshape(rows, self.kv_heads, self.group, self.head_dim)
        scores = torch.matmul(queries, keys.transpose(-1, -2)) + padding  # [rows, kv heads, group, length]
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        return torch.matmul(weights, values).reshape(rows, 1, -1)

    def _mlp_and_residuals(self, layer: _Layer, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of a layer after attention: output projection, residual, MLP, residual."""
        hidden = hidden + layer.o(attended)
        gate, up = layer.gate_up(self._rms(hidden, layer.post_attention_norm)).split(self.intermediate, dim=-1)
        return hidden + layer.down(F.silu(gate) * up)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """Float logits [rows, vocab] from each row's last hidden state [rows, hidden]."""
        return self.lm_head(self._rms(last, self.norm)).float()

    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        cos, sin = self._rotary(positions)
        allowed = self._prefill_mask(mask)
        hidden = F.embedding(input_ids, self.embed)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.layers:
            q, k, v = self._qkv(layer, self._rms(hidden, layer.input_norm), cos, sin)
            kv.append((k, v))
            hidden = self._mlp_and_residuals(layer, hidden, self._prefill_attention(q, k, v, allowed))
        return self._logits(hidden[:, -1]), kv

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        cos, sin = self._rotary(positions)
        padding = self._decode_padding(kv)
        hidden = F.embedding(input_ids, self.embed)
        for layer, slab in zip(self.layers, kv.slabs(), strict=True):
            q, k, v = self._qkv(layer, self._rms(hidden, layer.input_norm), cos, sin)
            hidden = self._mlp_and_residuals(layer, hidden, self._decode_attention(q, k, v, slab, padding))
        return self._logits(hidden[:, -1])

    def mixed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        decode_ids: torch.Tensor,
        decode_positions: torch.Tensor,
        kv: KVBatch,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """A prefill of new prompts and a decode step of the running rows in one pass: the projections
        and the MLP see the prompts' tokens and the decode rows' tokens together, so each weight is read
        once; attention is computed apart. Returns prefill's logits and keys and values, and decode's
        logits (whose keys and values go into `kv`, as in `decode`)."""
        rows, tokens = input_ids.shape
        split = rows * tokens
        cos, sin = self._rotary(positions)
        decode_cos, decode_sin = self._rotary(decode_positions)
        allowed, padding = self._prefill_mask(mask), self._decode_padding(kv)
        embedded = (F.embedding(input_ids, self.embed), F.embedding(decode_ids, self.embed))
        hidden = torch.cat([e.reshape(1, -1, e.shape[-1]) for e in embedded], dim=1)  # [1, all tokens, hidden]
        new: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer, slab in zip(self.layers, kv.slabs(), strict=True):
            projected = layer.qkv(self._rms(hidden, layer.input_norm))
            q, k, v = self._heads(projected[0, :split].view(rows, tokens, -1), cos, sin)
            new.append((k, v))
            prompts = self._prefill_attention(q, k, v, allowed)
            q, k, v = self._heads(projected[0, split:].unsqueeze(1), decode_cos, decode_sin)
            decoded = self._decode_attention(q, k, v, slab, padding)
            attended = torch.cat((prompts.reshape(1, split, -1), decoded.reshape(1, -1, decoded.shape[-1])), dim=1)
            hidden = self._mlp_and_residuals(layer, hidden, attended)
        logits = self._logits(torch.cat((hidden[0, :split].view(rows, tokens, -1)[:, -1], hidden[0, split:])))
        return logits[:rows], new, logits[rows:]
