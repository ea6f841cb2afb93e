"""The bin grid of the histogram calibrator: where it starts, how it grows, how two grids meet.

A grid (per histogram row) is a bin width ``w`` (float32) and a bin count
``n``: bins ``[j * w, (j + 1) * w)`` for ``j < n``, the top edge ``n * w``
closed. Binning is ``floor(|x| * fl(1 / w))`` whatever ``n`` is, so a count
never depends on how far the grid reached when it was taken: the kernel pass
runs ``K = kernel_bins(n)`` bins (a power of two) on the range ``K * w``
(exact), and the kernel's ``fl(1 / (K w)) * K`` is exactly ``fl(1 / w)``.

* **Start** (the reference toolkit's grid): ``num_bins`` bins on ``[0, R]``,
  ``R`` the range when it is known in advance (:meth:`set_range`, which
  :mod:`lq.calibration` does after a range pass) or else the absmax of the
  first batch that holds a nonzero value. ``w`` is ``R / num_bins`` rounded up
  to float32, so the grid always covers ``R``.
* **Growth** (also the reference's): a later batch reaching past the top
  appends bins of the same width, ``n = ceil(max / w)``; old counts stay where
  they are. Unlike the reference, growth is bounded: past ``max_bins`` bins,
  pairs of bins merge (``w`` doubles) until the grid fits. Merging pairs is
  exact: the bins of width ``2w`` are unions of bins of width ``w``, and
  ``fl(1 / 2w) = fl(1 / w) / 2``, so a value lands in the same coarse bin
  whether it was binned before or after.
* **Meeting** (merge, sync): two grids whose widths differ by a power of two
  (the same start, any growth) are re-binned onto the coarser one exactly, so
  merged counts equal the counts of one calibrator that saw all the data.
  Grids that started on different ranges cannot be aligned; they are re-binned
  onto the coarser one by bin center (each count moves less than one bin).
"""

from __future__ import annotations

import torch

__all__ = ["bins_needed", "coarsen", "holds", "kernel_bins", "onto", "pad", "rebin", "regrid", "start_width"]


def start_width(rng: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Smallest float32 ``w`` with ``num_bins * w >= rng`` (float32, per row; 0 where ``rng`` is 0)."""
    r = rng.double()
    w = (r / num_bins).float()
    short = w.double() * num_bins < r
    return torch.where(short, torch.nextafter(w, torch.full_like(w, float("inf"))), w)


def bins_needed(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Smallest ``n`` with ``n * w >= m`` (int64, per row; 0 where ``w`` is 0)."""
    wd = w.double()
    safe = torch.where(wd > 0, wd, torch.ones_like(wd))
    n = torch.ceil(m.double() / safe)
    n = torch.where(n * safe < m.double(), n + 1, n)  # the quotient rounded down
    return torch.where(wd > 0, n, torch.zeros_like(n)).long()


def coarsen(w: torch.Tensor, n: torch.Tensor, max_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Double ``w`` (halving ``n``, rounded up) in every row until ``n <= max_bins``."""
    while bool((n > max_bins).any()):
        over = n > max_bins
        w = torch.where(over, w * 2, w)
        n = torch.where(over, (n + 1) // 2, n)
    return w, n


def rebin(counts: torch.Tensor, w_src: torch.Tensor, w_dst: torch.Tensor, n_dst: torch.Tensor) -> torch.Tensor:
    """``counts (C, S)`` on widths ``w_src`` moved onto widths ``w_dst`` with ``n_dst`` bins per row.

    Source bin ``j`` goes to the destination bin holding its center,
    ``floor((j + 1/2) * w_src / w_dst)``, at most ``n_dst - 1`` (the top edge
    is closed). Exact when ``w_dst / w_src`` is a power of two (1 included).
    Returns ``(C, max(n_dst))`` (at least one column).
    """
    C, S = counts.shape
    dev = counts.device
    src, dst = w_src.double().reshape(C, 1).to(dev), w_dst.double().reshape(C, 1).to(dev)
    ratio = torch.where(dst > 0, src / torch.where(dst > 0, dst, torch.ones_like(dst)), torch.zeros_like(dst))
    last = (n_dst.reshape(C, 1).to(dev) - 1).clamp(min=0)
    j = torch.arange(S, device=dev, dtype=torch.float64).reshape(1, S)
    idx = torch.minimum(torch.floor((j + 0.5) * ratio).long(), last)
    out = torch.zeros(C, max(1, int(n_dst.max())), dtype=counts.dtype, device=dev)
    return out.scatter_add_(1, idx, counts)


def kernel_bins(n: int) -> int:
    """Bins of the kernel pass for a grid of ``n`` bins: the power of two >= ``n`` (see the module doc)."""
    return 1 << max(0, int(n) - 1).bit_length()


def regrid(counts, w_src, n_src, w_dst):
    """Counts and bin counts of rows moved from widths ``w_src`` to (coarser or equal) widths ``w_dst``."""
    w_dst = w_dst.to(counts.device)
    covered = bins_needed(n_src.to(counts.device).double() * w_src.to(counts.device).double(), w_dst)
    n_dst = torch.where(w_dst > 0, covered.clamp(min=1), n_src.to(counts.device))
    return rebin(counts, w_src, w_dst, n_dst), n_dst


def holds(absmax, w, n) -> bool:
    """Whether every row's grid ``(w, n)`` holds values up to ``absmax`` (scalars per tensor: less overhead)."""
    if absmax.numel() == 1:
        a, wf = float(absmax), float(w)
        return a <= wf * int(n) and (wf > 0 or a == 0)
    return bool(((absmax.double() <= w.double() * n) & ((w > 0) | (absmax == 0))).all())


def onto(counts, w_src, w_dst, n_dst, cols: int):
    """A batch's kernel counts (width ``w_src``) as rows of ``cols`` bins on the grid ``(w_dst, n_dst)``.

    Counts at or past a row's last bin are values on its (closed) top edge: they join the last bin.
    """
    if w_src is w_dst and (n_dst.numel() == 1 or bool((n_dst == cols).all())):  # same grid, rows full: fold, cut
        if counts.shape[1] > cols:
            counts[:, cols - 1] += counts[:, cols:].sum(1)
        return counts[:, :cols]
    return pad(rebin(counts, w_src, w_dst, n_dst), cols)


def pad(counts: torch.Tensor, cols: int) -> torch.Tensor:
    return counts if counts.shape[1] >= cols else torch.nn.functional.pad(counts, (0, cols - counts.shape[1]))
