"""One training step of a small decoder block whose attention and MoE run on ``torch.ops.nki``:
the example of the README's migration section (``nki-lib dry-run examples.migration_step:step``)."""

import torch
from torch import nn

import nki_lib


class Block(nn.Module):
    def __init__(self, hidden=256, heads=4, kv_heads=2, experts=8, top_k=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.moe = nki_lib.moe.MoE(hidden, 2 * hidden, num_experts=experts, top_k=top_k, block_size=64)
        for p in (self.moe.router_weight, self.moe.w_gate_up, self.moe.w_down):
            nn.init.normal_(p, std=hidden ** -0.5)

    def forward(self, x):
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = nki_lib.flash_attention(q, k, v, causal=True)          # was F.scaled_dot_product_attention
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.moe(x)                                         # was a per-expert loop


torch.manual_seed(0)
model = Block().to(torch.bfloat16)
tokens = torch.randn(2, 256, 256, dtype=torch.bfloat16)


def step():
    loss = model(tokens).float().pow(2).mean()
    loss.backward()
    return loss
