"""The benchmark's corpus: the fortune cookies of Debian's `fortunes` package, as bytes.

/usr/share/games/fortunes holds about 15,000 quotations, jokes and poems (2.5 MB of English
text) in files of entries separated by lines of "%". Every 20th entry (in a fixed order of the
files) is held out for validation; the rest is the training split. Characters are bytes
(vocabulary 256; the files are ASCII with a few Latin-1 bytes). The split is saved once as a
torch file (prepare) and loaded by every worker (load).
"""

import os

import torch

FORTUNES = "/usr/share/games/fortunes"
VOCAB = 256
HELD_OUT_EVERY = 20


def entries(folder=FORTUNES):
    if not os.path.isdir(folder):
        raise SystemExit(f"{folder} is missing: install Debian's `fortunes` package "
                         "(bash deploy/install_deps.sh)")
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if "." in name or not os.path.isfile(path):
            continue  # .dat indexes, .u8 links
        with open(path, "rb") as f:
            text = f.read()
        out.extend(e.strip(b"\n") + b"\n" for e in text.split(b"\n%\n") if e.strip())
    return out


def prepare(path, folder=FORTUNES):
    """Writes the split to `path`; returns (train bytes, validation bytes)."""
    es = entries(folder)
    val = b"".join(e for i, e in enumerate(es) if i % HELD_OUT_EVERY == 0)
    train = b"".join(e for i, e in enumerate(es) if i % HELD_OUT_EVERY != 0)
    torch.save({"train": torch.frombuffer(bytearray(train), dtype=torch.uint8),
                "val": torch.frombuffer(bytearray(val), dtype=torch.uint8),
                "entries": len(es)}, path)
    return len(train), len(val)


def load(path):
    return torch.load(path)


def batch(data, batch_size, context, gen):
    """A batch of random windows: (inputs, next-byte targets), int64 [batch, context]."""
    starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


def batches(data, n, batch_size, context, gen):
    return [batch(data, batch_size, context, gen) for _ in range(n)]
