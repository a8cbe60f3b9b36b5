"""Convergence: a tiny transformer (nki flash attention + nki MoE) trained from one seed on a fixed
synthetic task on the simulator path (strict: every op runs its NKI kernels) and on the
reference path; the loss curves agree and the loss falls.

Agreement is judged with the parity rule of ``nki_lib.numerics`` on the whole loss curve: a
float64 run on the reference path is the oracle, the float32 reference run is the baseline, and
the float32 simulator run may deviate from the oracle by at most the ``("output", float32)``
allowance (2x the baseline's deviation plus the float32 noise floor).

Model: vocab V, d_model D, L layers of [LayerNorm -> causal attention (Hd heads) -> LayerNorm ->
MoE (E experts, top-k, SwiGLU, one shared expert) ], each with a residual; LM head.
Task: token i's target is ``(x_i + x_{i-1}) mod V`` (needs attention to the previous token).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import nki_lib
from nki_lib.moe import MoE, load_balancing_loss
from nki_lib.numerics import parity

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 16, 32, 2, 2, 16, 2
EXPERTS, TOP_K, INTER = 4, 2, 32
STEPS, LR, AUX_WEIGHT, NUM_BATCHES = 20, 1e-2, 1e-2, 4
LOSS_DROP = 0.5     # the mean loss of the last NUM_BATCHES steps must be below this share of the first


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_attn, self.norm_moe = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.moe = MoE(D_MODEL, INTER, EXPERTS, TOP_K, block_size=16, num_shared_experts=1)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = self.qkv(self.norm_attn(h)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attn = nki_lib.flash_attention(q, k, v, causal=True)                 # (B, Hd, S, D / Hd)
        h = h + self.proj(attn.transpose(1, 2).reshape(b, s, D_MODEL))
        return h + self.moe(self.norm_moe(h))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batches():
    gen = torch.Generator().manual_seed(7)
    data = []
    for _ in range(NUM_BATCHES):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        targets = (tokens + torch.roll(tokens, 1, dims=1)) % VOCAB
        targets[:, 0] = -100                                                    # no previous token
        data.append((tokens, targets))
    return data


def train(model, path, strict):
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    data = batches()
    with nki_lib.use_backend(path), nki_lib.strict(strict):
        for step in range(STEPS):
            tokens, targets = data[step % NUM_BATCHES]
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).to(torch.float64 if logits.dtype ==
                                               torch.float64 else torch.float32), targets.reshape(-1))
            aux = sum(load_balancing_loss(b.moe.last_logits, b.moe.last_topk_ids, EXPERTS) for b in model.blocks)
            opt.zero_grad(set_to_none=True)
            (loss + AUX_WEIGHT * aux).backward()
            opt.step()
            losses.append(loss.detach().to(torch.float64))
    return torch.stack(losses)


def test_tiny_transformer_converges_and_paths_agree():
    torch.manual_seed(0)
    model = TinyLM()
    oracle = train(copy.deepcopy(model).double(), "reference", strict=False)
    baseline = train(copy.deepcopy(model), "reference", strict=False)
    nki_lib.reset_coverage()
    simulated = train(copy.deepcopy(model), "simulator", strict=True)

    ledger = str(nki_lib.coverage())
    for op in ("flash_attention", "moe_router", "moe_router_backward", "moe_plan", "moe_experts"):
        assert op in ledger
    result = parity(simulated, oracle, baseline, kind="output", dtype=torch.float32, name="loss curve")
    assert result.ok, f"{result}\nsimulator {simulated.tolist()}\noracle {oracle.tolist()}"
    head, tail = simulated[:NUM_BATCHES].mean(), simulated[-NUM_BATCHES:].mean()
    assert tail < LOSS_DROP * head, f"loss did not fall: first {float(head):.3f}, last {float(tail):.3f}"
