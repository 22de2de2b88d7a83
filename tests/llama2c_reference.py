"""Ground truth for llama2.c checkpoints: llama2.c's C forward pass, restated in plain PyTorch.

Deliberately independent of Loom: it parses the `.bin` itself, keeps weights in the file's own
layout (no RoPE row permutation), and runs one token at a time against a KV cache exactly as
the C loop does, so a conversion or engine bug cannot hide behind shared code.
"""
from __future__ import annotations

import math
import struct
from pathlib import Path

import torch

EPS = 1e-5
ROPE_BASE = 10000.0


class Llama2cReference:
    def __init__(self, path: Path) -> None:
        raw = Path(path).read_bytes()
        (self.dim, self.hidden_dim, self.n_layers, self.n_heads, self.n_kv_heads,
         vocab, self.seq_len) = struct.unpack_from("<7i", raw, 0)
        self.vocab_size = abs(vocab)
        self.head_size = self.dim // self.n_heads
        self.kv_dim = self.n_kv_heads * self.head_size
        floats = torch.frombuffer(bytearray(raw[28:]), dtype=torch.float32)

        pos = 0

        def take(*shape: int) -> torch.Tensor:
            nonlocal pos
            n = math.prod(shape)
            t = floats[pos:pos + n].reshape(shape)
            pos += n
            return t

        L, d, kv, hid = self.n_layers, self.dim, self.kv_dim, self.hidden_dim
        self.tok_emb = take(self.vocab_size, d)
        self.rms_att = take(L, d)
        self.wq = take(L, d, d)
        self.wk = take(L, kv, d)
        self.wv = take(L, kv, d)
        self.wo = take(L, d, d)
        self.rms_ffn = take(L, d)
        self.w1 = take(L, hid, d)
        self.w2 = take(L, d, hid)
        self.w3 = take(L, hid, d)
        self.rms_final = take(d)
        take(self.seq_len, self.head_size)  # legacy freq_cis real + imag halves, unused
        self.wcls = self.tok_emb if vocab > 0 else take(self.vocab_size, d)
        assert pos == floats.numel(), "file size does not match the header"
        self.reset()

    def reset(self) -> None:
        self.key_cache = torch.zeros(self.n_layers, self.seq_len, self.kv_dim)
        self.value_cache = torch.zeros(self.n_layers, self.seq_len, self.kv_dim)

    @staticmethod
    def _rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x / torch.sqrt((x * x).mean() + EPS))

    def _rope(self, v: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotate each consecutive pair (v[2j], v[2j+1]) of every head by pos * freq_j."""
        pairs = v.reshape(-1, self.head_size // 2, 2)
        j = torch.arange(self.head_size // 2, dtype=torch.float32)
        angle = pos * ROPE_BASE ** (-2.0 * j / self.head_size)
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).reshape(v.shape)

    def forward(self, token: int, pos: int) -> torch.Tensor:
        """Logits for `token` at position `pos`; caches its keys and values like the C code."""
        hs = self.head_size
        group = self.n_heads // self.n_kv_heads  # query heads sharing one KV head
        x = self.tok_emb[token].clone()
        for layer in range(self.n_layers):
            xb = self._rmsnorm(x, self.rms_att[layer])
            q = self._rope(self.wq[layer] @ xb, pos)
            self.key_cache[layer, pos] = self._rope(self.wk[layer] @ xb, pos)
            self.value_cache[layer, pos] = self.wv[layer] @ xb

            out = torch.empty(self.dim)
            for h in range(self.n_heads):
                kv_h = h // group
                qh = q[h * hs:(h + 1) * hs]
                keys = self.key_cache[layer, :pos + 1, kv_h * hs:(kv_h + 1) * hs]
                values = self.value_cache[layer, :pos + 1, kv_h * hs:(kv_h + 1) * hs]
                att = torch.softmax(keys @ qh / hs ** 0.5, dim=0)
                out[h * hs:(h + 1) * hs] = att @ values
            x = x + self.wo[layer] @ out

            xb = self._rmsnorm(x, self.rms_ffn[layer])
            gate = self.w1[layer] @ xb
            hidden = gate * torch.sigmoid(gate) * (self.w3[layer] @ xb)
            x = x + self.w2[layer] @ hidden
        return self.wcls @ self._rmsnorm(x, self.rms_final)

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Argmax continuation of `prompt`, never stopping early (EOS/BOS are just tokens)."""
        self.reset()
        generated: list[int] = []
        token = prompt[0]
        for pos in range(len(prompt) + max_new_tokens - 1):
            logits = self.forward(token, pos)
            if pos + 1 < len(prompt):
                token = prompt[pos + 1]
            else:
                token = int(torch.argmax(logits))
                generated.append(token)
        return generated
