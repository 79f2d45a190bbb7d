"""ict_jax.model.gguf_reader: the header's extent (the bytes a GGUF file must have) from a walk of the header
alone, equal to gguf.GGUFReader's; a truncated file fails at once with both sizes, before the slow parse."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ict_jax.model.gguf_reader import TruncatedGGUF, gguf_extent, open_gguf, release_gguf

gguf = pytest.importorskip("gguf")


def _write(path, *, alignment=None):
    """A small GGUF with a string array (a tokenizer's shape), F32, F16 and Q8_0 tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(1)
    w.add_token_list([f"t{i}" for i in range(500)])
    w.add_token_scores([0.5] * 500)
    w.add_tensor("token_embd.weight", np.ones((500, 32), np.float32))
    q8 = gguf.quants.quantize(np.random.default_rng(0).random((8, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones((32,), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_extent_is_the_readers(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment=alignment)
    reader = gguf.GGUFReader(str(path))
    want = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    assert gguf_extent(path) == want and path.stat().st_size >= want


def test_a_truncated_file_fails_at_once_with_both_sizes(tmp_path):
    whole = _write(tmp_path / "m.gguf").read_bytes()
    extent = gguf_extent(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:extent // 2])  # the tensor data cut
    release_gguf()
    t0 = time.perf_counter()
    with pytest.raises(TruncatedGGUF) as e:
        open_gguf(cut)
    assert time.perf_counter() - t0 < 5
    assert str(e.value) == (f"{cut}: truncated: {extent // 2:,} bytes of the {extent:,} bytes its header describes "
                            "(an interrupted download or copy?)")
    cut.write_bytes(whole[:3000])  # inside the header (the token list)
    with pytest.raises(TruncatedGGUF, match=r"truncated: 3,000 bytes, and its header runs past that end"):
        open_gguf(cut)
    cut.write_bytes(whole[:10])
    with pytest.raises(TruncatedGGUF, match="shorter than a GGUF header"):
        open_gguf(cut)
    cut.write_bytes(b"not a gguf file at all, " * 4)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(cut)
    cut.write_bytes(whole)  # the whole file opens
    assert [t.name for t in open_gguf(cut).tensors][0] == "token_embd.weight"
    release_gguf()


def test_sizes_are_written_in_mb_past_a_megabyte(tmp_path):
    """The real 0.5B cut to 10 MB reads "truncated: 10 MB of the 491 MB its header describes"."""
    from ict_jax.model.gguf_reader import _mb

    assert (_mb(10_000_000), _mb(491_400_064), _mb(12_512)) == ("10 MB", "491 MB", "12,512 bytes")
