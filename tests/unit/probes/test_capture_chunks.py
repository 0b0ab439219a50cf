"""The unit capture's peak is bounded below one layer (issue 50, item 6): a flush forms at most PRODUCT_BYTES of
per-sequence weight gradients at once, chunking within a layer by whole groups, or by a group's sequences when one
group does not fit, and the norms are those of the unchunked flush."""

from __future__ import annotations

import pytest
import torch

from rl_training.probes.capture import LoraUnitCapture, product_chunks
from tests.helpers import G, backward, one_micro_batch, probe_step

N_GROUPS = 4


@pytest.mark.parametrize(
    ("n_items", "group_items", "item_bytes", "bound", "chunks"),
    [
        # 12 items, groups of 3, 10 bytes each, 75 bytes: 7 items fit, rounded down to 2 whole groups (6 items)
        (12, 3, 10, 75, [(0, 6), (6, 12)]),
        # 25 bytes: 2 items fit, less than a group: each group in pieces of 2, never across its end
        (9, 3, 10, 25, [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8), (8, 9)]),
        # an item over the bound on its own: one item per chunk (the least there is)
        (4, 2, 100, 1, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        # one unit per group (the group level alone): 3 items per chunk, the last short
        (7, 1, 8, 24, [(0, 3), (3, 6), (6, 7)]),
        # everything fits: one chunk
        (8, 4, 1, 10**9, [(0, 8)]),
    ],
)
def test_product_chunks_obey_the_bound_and_keep_groups_whole(n_items, group_items, item_bytes, bound, chunks):
    got = product_chunks(n_items, group_items, item_bytes, bound)
    assert got == chunks
    assert [i for lo, hi in got for i in range(lo, hi)] == list(range(n_items))  # every item once, in order
    for lo, hi in got:
        assert (hi - lo) * item_bytes <= bound or hi - lo == 1
        whole = lo % group_items == 0 and hi % group_items == 0
        assert whole or lo // group_items == (hi - 1) // group_items  # whole groups, or inside one group


@pytest.fixture(scope="module")
def setup(tiny_model):
    model, ro, adv, norm = probe_step(tiny_model, N_GROUPS, 5, 4, [0.9, -0.3, 0.2, -0.8, 1.0, -1.0, -0.4, 0.6])
    return model, one_micro_batch(ro, adv, list(range(N_GROUPS))), norm


def captured(setup, bound: int, monkeypatch, group_size: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(group norms, sequence norms, (items, bytes per item) of every product formed) of one flush under
    PRODUCT_BYTES = bound."""
    model, mb, norm = setup
    monkeypatch.setattr(LoraUnitCapture, "PRODUCT_BYTES", bound)
    sizes: list[tuple[int, int]] = []
    real_bmm = torch.bmm

    def bmm(a, b):
        out = real_bmm(a, b)
        sizes.append((out.shape[0], out[0].numel() * out.element_size()))
        return out

    cap = LoraUnitCapture(model)
    try:
        model.zero_grad(set_to_none=True)
        per_seq = {"group_sizes": (group_size,) * N_GROUPS, "per_sequence": True} if group_size else {}
        with cap.capture(N_GROUPS, **per_seq):
            backward(model, mb, norm)
            monkeypatch.setattr(torch, "bmm", bmm)  # the flush's products only (disarm flushes)
        monkeypatch.setattr(torch, "bmm", real_bmm)
        assert cap.hooks_ok and cap.error is None
        return cap.unit_sq_norms.clone(), cap.seq_sq_norms.clone(), sizes
    finally:
        cap.remove()


@pytest.mark.parametrize("group_size", [G, 0])
def test_chunked_norms_equal_the_unchunked_ones(setup, monkeypatch, group_size):
    # The tiny model's LoRA products (r=4, float64) are 2, 4 or 12 KiB per sequence, 8 sequences (4 groups of G=2)
    # per layer. Under 8 KiB a product holds 4 sequences of 2 KiB (2 whole groups), 2 of 4 KiB (one group) or one of
    # 12 KiB (over the bound alone: its group split in two, the sum carried); under 1 byte one sequence each;
    # under 2**40 every layer of a shape at once (up to 192 sequences, 768 KiB).
    groups, seqs, sizes = captured(setup, 2**40, monkeypatch, group_size)
    assert max(n * b for n, b in sizes) > 8 * 2**10  # the unchunked flush forms more than the bound below at once
    for bound in (8 * 2**10, 1):
        g, s, sizes = captured(setup, bound, monkeypatch, group_size)
        torch.testing.assert_close(g, groups, rtol=1e-12, atol=0)
        torch.testing.assert_close(s, seqs, rtol=1e-12, atol=0)
        assert all(n * b <= bound or n == 1 for n, b in sizes), (bound, sorted(set(sizes)))
    assert groups.shape == (N_GROUPS,) and seqs.shape == (N_GROUPS * group_size,)
    assert bool((groups > 0).all())
