"""Weight buckets cross Ray as NumPy views of their bytes: every dtype comes back bit-exact, shapes and names kept,
non-contiguous and zero-dimensional tensors included, through pickling as Ray does it (protocol 5, out of band)."""

from __future__ import annotations

import pickle

import torch

from megarl.workers.bucket_transport import pack_bucket, unpack_bucket


def test_pack_unpack_is_bit_exact_for_every_dtype():
    g = torch.Generator().manual_seed(0)
    bucket = [
        ("w.fp32", torch.randn(3, 5, generator=g)),
        ("w.bf16", torch.randn(4, 2, generator=g).to(torch.bfloat16)),
        ("w.fp16", torch.randn(7, generator=g).to(torch.float16)),
        ("w.transposed", torch.randn(4, 6, generator=g).t()),  # not contiguous
        ("scalar", torch.tensor(3.5)),
        ("ids", torch.arange(10, dtype=torch.int64)),
        ("nan", torch.tensor([float("nan"), float("inf"), -0.0])),
    ]
    buffers = []
    wire = pickle.dumps(pack_bucket(bucket), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(bucket)  # every tensor's bytes travel out of band, as Ray sends NumPy arrays
    unpacked = unpack_bucket(pickle.loads(wire, buffers=buffers))
    assert [name for name, _ in unpacked] == [name for name, _ in bucket]
    for (_, sent), (_, got) in zip(bucket, unpacked):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.view(-1).view(torch.uint8), sent.contiguous().view(-1).view(torch.uint8))
