"""The shared-memory exchange's arena: staged pieces read back bit for bit by a peer, growth into a
new generation, and every file removed once its regions are freed."""

import os

import torch

from nccl_ext.exchange.arena import Arena, PeerViews, detached


def test_a_peer_reads_staged_pieces_bit_for_bit(tmp_path):
    arena, peer = Arena(str(tmp_path), 5, initial_bytes=1 << 20), PeerViews(str(tmp_path))
    pieces = [torch.randn(7, 3).to(torch.bfloat16), torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
              torch.empty(0), torch.tensor([True, False])]
    gen, descs, _ = arena.put(pieces)
    seen = peer.views((5, gen, descs))
    for a, b in zip(pieces, seen):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    kept = detached(seen[0])  # outlives the region
    arena.close()
    peer.close()
    assert torch.equal(kept, pieces[0]) and os.listdir(tmp_path) == []


def test_growth_starts_a_new_generation_and_drops_the_old_once_empty(tmp_path):
    arena = Arena(str(tmp_path), 0, initial_bytes=1 << 20)
    _g0, _d, first = arena.put([torch.zeros(1000)])
    g1, d1, big = arena.put([torch.ones(600_000)])  # 2.4 MB: past the first file
    assert g1 == 1 and sorted(os.listdir(tmp_path)) == ["r0-g0", "r0-g1"]
    assert torch.equal(PeerViews(str(tmp_path)).views((0, g1, d1))[0], torch.ones(600_000))
    arena.free(first)
    assert os.listdir(tmp_path) == ["r0-g1"]
    arena.free(big)
    _g, _d, again = arena.put([torch.ones(600_000)])  # freed space is used again
    assert _g == 1
    arena.close()
    assert os.listdir(tmp_path) == []
