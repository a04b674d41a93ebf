"""A small decoder-only transformer over bytes (pre-norm, learned positions, tied embedding)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CharTransformer(nn.Module):
    def __init__(self, vocab, context, d_model, layers, heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model,
                                           dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")),
                                                diagonal=1), persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x, y):
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t])
        logits = self.norm(h) @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(net, batches):
    """Mean cross-entropy (nats per byte) over the held-out batches."""
    was = net.training
    net.eval()
    total = sum(float(net(x, y)) for x, y in batches) / len(batches)
    net.train(was)
    return total
