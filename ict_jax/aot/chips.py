"""The accelerator chips the roofline and ``--fit`` know: one table, each figure with its source
(docs/tpu.md "Roofline").

Per chip: peak dense bfloat16 FLOP/s, HBM bandwidth (bytes/s) and inter-chip bandwidth (bytes/s,
bidirectional, per chip). Vendor figures, not measurements: a roofline built on them is a ceiling.

Sources:

- TPU v4: Cloud TPU "TPU v4" system-architecture page (cloud.google.com/tpu/docs/v4): 275 TFLOP/s
  (bf16), HBM2 32 GiB at 1,200 GB/s. The page gives no per-chip ICI figure: 300 GB/s is an estimate
  kept for ranking ``--fit`` candidates only.
- TPU v5e: "TPU v5e" page (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s (bf16), HBM2 16 GB at 819 GB/s,
  bidirectional ICI 400 GB/s per chip.
- TPU v5p: "TPU v5p" page (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s (bf16), HBM2e 95 GB at 2,765
  GB/s, bidirectional ICI 1,200 GB/s per chip.
- TPU v6e (Trillium): "TPU v6e" page (cloud.google.com/tpu/docs/v6e): 918 TFLOP/s (bf16), HBM 32 GB at
  1,638 GB/s (1,640 here), bidirectional ICI 800 GB/s per chip.
- NVIDIA H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU datasheet: BF16 Tensor Core 989 TFLOP/s dense
  (1,979 with 2:4 sparsity), HBM3 3.35 TB/s, NVLink 900 GB/s. H100 PCIe: 756 TFLOP/s dense, HBM2e
  2.0 TB/s (same datasheet; NVLink bridge 600 GB/s).
- NVIDIA H200 SXM 141 GB: NVIDIA H200 Tensor Core GPU datasheet: BF16 989 TFLOP/s dense (the H100's
  compute), HBM3e 4.8 TB/s, NVLink 900 GB/s.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's vendor figures."""

    name: str
    peak_flops: float  # dense bfloat16 FLOP/s
    hbm_bw: float  # bytes/s
    ici_bytes: float  # bytes/s between chips, bidirectional, per chip
    device_kinds: tuple[str, ...]  # prefixes of jax's ``device.device_kind`` for this chip
    source: str


#: The one table of chips (module docstring: the sources).
CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v4", 275e12, 1200e9, 300e9, ("TPU v4",), "cloud.google.com/tpu/docs/v4 (ICI: an estimate)"),
    Chip("v5e", 197e12, 819e9, 400e9, ("TPU v5 lite", "TPU v5e"), "cloud.google.com/tpu/docs/v5e"),
    Chip("v5p", 459e12, 2765e9, 1200e9, ("TPU v5p", "TPU v5"), "cloud.google.com/tpu/docs/v5p"),
    Chip("v6e", 918e12, 1640e9, 800e9, ("TPU v6 lite", "TPU v6e"), "cloud.google.com/tpu/docs/v6e"),
    Chip("h100", 989e12, 3.35e12, 900e9, ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", "NVIDIA H100"),
         "NVIDIA H100 datasheet (SXM5)"),
    Chip("h100-pcie", 756e12, 2.0e12, 600e9, ("NVIDIA H100 PCIe",), "NVIDIA H100 datasheet (PCIe)"),
    Chip("h200", 989e12, 4.8e12, 900e9, ("NVIDIA H200",), "NVIDIA H200 datasheet (SXM)"),
)}


def chip_named(name: str) -> Chip:
    """The chip called ``name`` (``v5e``, ``h100``, ...); ValueError listing the known ones."""
    if name not in CHIPS:
        raise ValueError(f"unknown chip {name!r}; known: {', '.join(CHIPS)}")
    return CHIPS[name]


def chip_for(generation: str | None = None, device_kind: str | None = None) -> Chip | None:
    """The chip of a TPU ``generation`` (``v5e``, ...) or of a jax ``device_kind`` string (the longest
    matching prefix: ``NVIDIA H100 PCIe`` is not an SXM H100); None when the table does not know it (a
    CPU)."""
    if generation in CHIPS:
        return CHIPS[generation]
    if device_kind:
        best = max(((len(p), c) for c in CHIPS.values() for p in c.device_kinds if device_kind.startswith(p)),
                   key=lambda t: t[0], default=None)
        return None if best is None else best[1]
    return None
