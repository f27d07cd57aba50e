"""Fetch, patch and build the pinned llama.cpp into an out-of-tree cache.

The one pin is ``vendor-manifest.json`` at the repository root: the llama.cpp commit, the
PyPI sdist that vendors exactly that tree (with its sha256), the ordered patch stack (a
sha256 per patch) and the cmake options. Everything this module writes lives in a workspace
under ``$DGR_CACHE`` (default ``~/.cache/dgr``) keyed by a hash of the manifest, the patches,
the cmake options (``CMAKE_ARGS`` included), the compiler and, for a native build (ggml's
default: ``-march=native``), the host CPU's instruction sets, so a rebuild with the same
inputs costs nothing and a change of any input gets a fresh workspace (a cache shared by
hosts of different CPUs keeps a build for each).

Only the standard library is used: ``setup.py`` imports this module before any dependency
is installed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dgr.errors import VendorError
from dgr.vendor.cpu import (CPU_REQUIRES, CPU_VARIANTS, _host_isa, cpu_features,
                            selected_cpu_variant)

__all__ = ["Vendor", "BACKENDS", "CPU_VARIANTS", "cache_root", "repo_root", "sha256_file",
           "cpu_features", "selected_cpu_variant"]

STAMP_VERSION = 1

#: The ggml backends a build can add to the CPU one (always in), and the cmake options that
#: turn each on. One backend per build: a CUDA build does not carry Vulkan, so every build
#: lives in its own workspace (the backend is part of the key) and they coexist in the cache.
BACKENDS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "vulkan": ("-DGGML_VULKAN=ON",),
    "cuda": ("-DGGML_CUDA=ON",),
    "rocm": ("-DGGML_HIP=ON",),
    "metal": ("-DGGML_METAL=ON",),
}

#: What each backend needs on the build machine (checked before configuring, so a missing
#: toolchain is named at once instead of by a cmake error half a page long).
PREREQUISITES = {
    "vulkan": "the Vulkan headers and loader, glslc and the SPIR-V headers (Debian: libvulkan-dev "
              "glslc spirv-headers; a Vulkan driver to run on, e.g. mesa-vulkan-drivers)",
    "cuda": "the CUDA toolkit: nvcc, the CUDA runtime and cuBLAS",
    "rocm": "ROCm with HIP and hipBLAS (hipcc, or clang from ROCm as the HIP compiler)",
    "metal": "macOS with the Metal framework (Xcode command line tools)",
}

#: Top-level folders of the pinned tree that no build needs (documentation, the vocabulary
#: files of upstream's tests, media): a prepared source archive leaves them out.
PREPARED_EXCLUDE = ("docs", "models", "media", ".github", ".devops")

#: Where ``setup.py`` records the backend it built the compiled core with, so the programs of
#: this checkout (tests building llama-completion, benches) find the same workspace without
#: ``DGR_BACKEND`` set again. Ignored by git.
BACKEND_RECORD = Path("dgr") / "_core" / "backend.txt"


def selected_backend(root: Path | None = None) -> str:
    """The backend a build of this checkout uses: ``$DGR_BACKEND``, else the one ``setup.py``
    last built the compiled core with, else ``cpu``. ``$DGR_BACKEND`` may list backends in
    order of preference (``vulkan,cpu``): the first whose toolchain this machine has is
    taken, and the choice is said."""
    env = os.environ.get("DGR_BACKEND", "").strip().lower()
    if env:
        return env
    try:
        rec = ((root or repo_root()) / BACKEND_RECORD).read_text().strip().lower()
    except OSError:
        rec = ""
    return rec or "cpu"


def repo_root() -> Path:
    """The source checkout holding ``vendor-manifest.json`` and ``patches/``."""
    return Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    """``$DGR_CACHE`` or ``~/.cache/dgr``."""
    env = os.environ.get("DGR_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dgr"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _say(msg: str) -> None:
    print(f"[dgr.vendor] {msg}", file=sys.stderr, flush=True)


def _compiler_id() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        first = out.splitlines()[0] if out else cxx
    except (OSError, subprocess.SubprocessError):
        first = cxx
    return f"{cxx}: {first}"


@dataclass(frozen=True)
class Patch:
    file: str
    sha256: str


#: upstream programs of the pinned tree that benchmarks build on demand besides the
#: manifest's ``cmake.tools``. A tool is a target of the same configured build, which it does
#: not change, so it stays out of the manifest (whose hash is the cache key: listing one there
#: would rebuild every cached llama.cpp)
EXTRA_TOOLS = ("llama-batched-bench",)


def _cmake_var(text: str, var: str) -> str:
    """A variable's value in a CMakeCache.txt's ``text`` ("" where it has none)."""
    m = re.search(rf"^{var}:\w+=(.*)$", text, re.M)
    return m.group(1).strip() if m else ""


def _lost_programs(cache: Path) -> bool:
    """Whether a CMakeCache.txt names a make program or cmake that no longer exists."""
    text = cache.read_text(errors="replace")
    return any((p := _cmake_var(text, var)) and not Path(p).exists()
               for var in ("CMAKE_MAKE_PROGRAM", "CMAKE_COMMAND"))


class Vendor:
    """One manifest's workspace: paths, key, and the fetch/patch/build steps.

    Parameters
    ----------
    root : Path, optional
        Repository root holding the manifest and ``patches/``.
    cache : Path, optional
        Cache root; defaults to :func:`cache_root`.
    """

    def __init__(self, root: Path | None = None, cache: Path | None = None,
                 backend: str | None = None):
        self.root = Path(root) if root else repo_root()
        spec = (backend or selected_backend(self.root)).strip().lower()
        choices = [b.strip() for b in spec.split(",") if b.strip()] or ["cpu"]
        unknown = [b for b in choices if b not in BACKENDS]
        if unknown:
            raise VendorError(f"unknown backend {unknown[0]!r} (from "
                              f"{'--backend' if backend else 'DGR_BACKEND'}); known: "
                              f"{', '.join(BACKENDS)}")
        self.backend = choices[0]
        for i, b in enumerate(choices):
            self.backend = b
            missing = self.missing_prerequisites()
            if not missing or i == len(choices) - 1:
                break
            _say(f"not building the {b} backend ({spec!r} lets this machine pass it): missing "
                 f"{'; '.join(missing)}; trying {choices[i + 1]}")
        self.cache = Path(cache) if cache else cache_root()
        manifest_path = self.root / "vendor-manifest.json"
        if not manifest_path.exists() and not (self.root / "setup.py").exists():
            raise VendorError(
                f"no llama.cpp tree here: this dgr is an installed package ({self.root}), which "
                "carries the compiled core but not llama.cpp's source. What needs the tree runs "
                "from a source checkout (`pip install -e .` there): the fixture generator and "
                "gguf-py (dgr.testing), llama.cpp's own programs for the benchmarks "
                "(llama-server, llama-bench, llama-batched-bench) and `python -m dgr.vendor`.")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as e:
            raise VendorError(f"cannot read {manifest_path}: {e}") from e
        self.llama = self.manifest["llama_cpp"]
        self.source = self.llama["source"]
        self.commit = self.llama["commit"]
        self.patches = [Patch(p["file"], p["sha256"]) for p in self.manifest.get("patches", [])]
        self.cpu_variant = selected_cpu_variant()
        self.cmake_options = (list(self.manifest["cmake"]["options"]) + list(BACKENDS[self.backend])
                              + list(CPU_VARIANTS[self.cpu_variant]))
        self.extra_cmake_args = shlex.split(os.environ.get("CMAKE_ARGS", ""))
        self.targets = list(self.manifest["cmake"]["targets"])
        self.known_tools = list(self.manifest["cmake"].get("tools", [])) + [
            t for t in EXTRA_TOOLS if t not in self.manifest["cmake"].get("tools", [])]

    # -- identity -------------------------------------------------------------------

    @property
    def cpu_variant_name(self) -> str:
        """What the records call this build's CPU code: the variant, or ``custom`` where
        ``CMAKE_ARGS`` turns ggml's native build off by itself."""
        if self.cpu_variant == "native" and not _host_isa(self.extra_cmake_args):
            return "custom"
        return self.cpu_variant

    def cpu_requires(self) -> tuple[str, ...]:
        return CPU_REQUIRES[self.cpu_variant]

    @property
    def patch_dir(self) -> Path:
        return self.root / "patches"

    def patch_stack_hash(self) -> str:
        """sha256 over the ordered patch contents (what a lane's identity records)."""
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.file.encode() + b"\0")
            path = self.patch_dir / p.file
            h.update(path.read_bytes() if path.exists() else b"<missing>")
            h.update(b"\0")
        return h.hexdigest()

    def key(self) -> str:
        h = hashlib.sha256()
        # the prepared archive's pin (``prepared``) names the same tree: not part of the key
        pinned = {k: v for k, v in self.manifest.items() if k != "prepared"}
        h.update(json.dumps(pinned, sort_keys=True).encode())
        h.update(self.patch_stack_hash().encode())
        if self.backend != "cpu":  # the CPU build's key has no backend term
            h.update(f"backend={self.backend}".encode())
        if self.cpu_variant != "native":  # the native build's key has no variant term
            h.update(f"cpu={self.cpu_variant}".encode())
        h.update(json.dumps(self.extra_cmake_args).encode())
        h.update(_compiler_id().encode())
        # a native build runs only on CPUs with what this one has (elsewhere: SIGILL)
        if isa := _host_isa(self.cmake_options + self.extra_cmake_args):
            h.update(f"isa={isa}".encode())
        return h.hexdigest()[:16]

    @property
    def workspace(self) -> Path:
        return self.cache / f"llama.cpp-{self.key()}"

    @property
    def src(self) -> Path:
        return self.workspace / "src"

    @property
    def build_dir(self) -> Path:
        return self.workspace / "build"

    @property
    def archive(self) -> Path:
        return self.cache / "downloads" / self.source["filename"]

    def _stamp(self, name: str) -> Path:
        return self.workspace / f"{name}.stamp.json"

    def _read_stamp(self, name: str) -> dict | None:
        try:
            return json.loads(self._stamp(name).read_text())
        except (OSError, ValueError):
            return None

    def _write_stamp(self, name: str, data: dict) -> None:
        data = {"stamp_version": STAMP_VERSION, "key": self.key(), "time": time.time(), **data}
        tmp = self._stamp(name).with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self._stamp(name))

    # -- fetch ----------------------------------------------------------------------

    def _download(self) -> None:
        dest = self.archive
        if dest.exists() and sha256_file(dest) == self.source["sha256"]:
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        spec = f"{self.source['package']}=={self.source['version']}"
        _say(f"downloading {spec} (source distribution) with pip")
        # Run pip outside any build-isolation overlay (setup.py may be running inside one).
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            # --no-binary names only this package: ":all:" would also force pip's isolated
            # metadata step to build the sdist's build requirements (cmake!) from source.
            base = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    self.source["package"], "--disable-pip-version-check", "-d", tmp, spec]
            # pip prepares the sdist's metadata; without isolation that needs its build backend
            # (scikit-build-core) installed, so fall back to pip's isolated preparation.
            for extra in (["--no-build-isolation"], []):
                proc = subprocess.run(base + extra, capture_output=True, text=True, env=env)
                got = Path(tmp) / self.source["filename"]
                if got.exists():
                    got.replace(dest)
                    return
            raise VendorError(
                f"pip download of {spec} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
            )

    # -- the prepared source archive (machines without a package registry) --------------

    def _prepared_members(self, tar: tarfile.TarFile) -> list[tuple[tarfile.TarInfo, str]]:
        """(member, path in the tree) of the pinned subtree's regular files a build needs."""
        prefix = self.source["subpath"].rstrip("/") + "/"
        out = []
        for m in tar.getmembers():
            if not m.isfile() or not m.name.startswith(prefix):
                continue
            rel = m.name[len(prefix):]
            if not rel or rel.startswith("/") or ".." in Path(rel).parts or rel == ".git":
                continue
            if rel.split("/", 1)[0] in PREPARED_EXCLUDE:
                continue
            out.append((m, rel))
        return sorted(out, key=lambda x: x[1])

    @staticmethod
    def tree_sha256(files: list[tuple[str, bytes]]) -> str:
        """sha256 over the sorted (path, sha256 of the bytes) of a tree's files."""
        h = hashlib.sha256()
        for rel, data in sorted(files):
            h.update(rel.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
        return h.hexdigest()

    def pack(self, dest: Path) -> tuple[Path, str]:
        """Write the prepared source archive: the pinned tree from the checked sdist, less
        ``PREPARED_EXCLUDE``, as a reproducible tar.gz (sorted, no times or owners). Returns
        (its path, the tree's sha256): what ``vendor-manifest.json`` pins as ``prepared``."""
        import gzip
        import io

        self._download()
        digest = sha256_file(self.archive)
        if digest != self.source["sha256"]:
            raise VendorError(f"{self.archive} has sha256 {digest}, the manifest pins "
                              f"{self.source['sha256']}: refusing to pack it")
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        files = []
        with tarfile.open(self.archive, "r:gz") as src, open(tmp, "wb") as raw, \
                gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as out:
            for m, rel in self._prepared_members(src):
                data = src.extractfile(m).read()
                files.append((rel, data))
                info = tarfile.TarInfo(rel)
                info.size, info.mode = len(data), m.mode & 0o755 | 0o644
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                out.addfile(info, io.BytesIO(data))
        tmp.replace(dest)
        return dest, self.tree_sha256(files)

    def _fetch_prepared(self, archive: Path) -> str:
        """Unpack a prepared source archive into the workspace after checking its tree
        against the manifest's ``prepared.tree_sha256``; returns that sha256."""
        pin = (self.manifest.get("prepared") or {}).get("tree_sha256")
        if not pin:
            raise VendorError("vendor-manifest.json pins no prepared source archive "
                              "(prepared.tree_sha256): build from the sdist")
        tmp = Path(tempfile.mkdtemp(prefix="src-", dir=self.workspace))
        files = []
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for m in tar.getmembers():
                    if not m.isfile() or m.name.startswith("/") or ".." in Path(m.name).parts:
                        raise VendorError(f"{archive}: {m.name!r} is not a file of a prepared tree")
                    data = tar.extractfile(m).read()
                    files.append((m.name, data))
                    path = tmp / m.name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
                    path.chmod(m.mode & 0o755 | 0o644)
        except (OSError, tarfile.TarError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise VendorError(f"cannot read the prepared source archive {archive}: {e}") from e
        got = self.tree_sha256(files)
        if got != pin:
            shutil.rmtree(tmp, ignore_errors=True)
            raise VendorError(f"{archive} holds a tree with sha256 {got}; the manifest pins "
                              f"{pin} (prepared.tree_sha256): refusing to build from it")
        if self.src.exists():
            shutil.rmtree(self.src)
        tmp.replace(self.src)
        return got

    def fetch(self) -> Path:
        """Download the pinned sdist, check its sha256, unpack the llama.cpp subtree; or,
        with ``$DGR_VENDOR_ARCHIVE``, unpack a prepared source archive (``pack``) checked
        against the manifest's ``prepared.tree_sha256`` (no network needed)."""
        if self.src.exists() and self._read_stamp("fetch"):
            return self.src
        prepared = os.environ.get("DGR_VENDOR_ARCHIVE")
        if prepared:
            self.workspace.mkdir(parents=True, exist_ok=True)
            _say(f"unpacking the prepared source archive {prepared}")
            tree = self._fetch_prepared(Path(prepared))
            for name in ("patch", "build"):
                self._stamp(name).unlink(missing_ok=True)
            self._write_stamp("fetch", {"commit": self.commit, "prepared_tree_sha256": tree})
            return self.src
        self._download()
        digest = sha256_file(self.archive)
        if digest != self.source["sha256"]:
            raise VendorError(
                f"{self.archive} has sha256 {digest}, the manifest pins {self.source['sha256']}: "
                "refusing to unpack (delete the file to download it again)"
            )
        self.workspace.mkdir(parents=True, exist_ok=True)
        if self.src.exists():
            shutil.rmtree(self.src)
        prefix = self.source["subpath"].rstrip("/") + "/"
        tmp = Path(tempfile.mkdtemp(prefix="src-", dir=self.workspace))
        _say(f"unpacking llama.cpp {self.commit[:12]} into {self.src}")
        with tarfile.open(self.archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise VendorError(f"{self.archive} has no {prefix!r} subtree")
            for i, m in enumerate(members):
                m.name = m.name[len(prefix):]
                if not m.name or m.name.startswith("/") or ".." in Path(m.name).parts:
                    continue
                tar.extract(m, tmp, filter="data")
                if (i + 1) % 2000 == 0 or i + 1 == len(members):
                    _say(f"  unpacked {i + 1}/{len(members)} files")
        # The sdist keeps a .git *file* pointing at a parent repository that is not there.
        gitfile = tmp / ".git"
        if gitfile.is_file():
            gitfile.unlink()
        tmp.replace(self.src)
        for name in ("patch", "build"):
            self._stamp(name).unlink(missing_ok=True)
        self._write_stamp("fetch", {"commit": self.commit, "archive_sha256": digest})
        return self.src

    # -- patch ----------------------------------------------------------------------

    def check_patches(self) -> list[str]:
        """Problems with the patch stack: missing files, sha256 mismatches, unlisted files."""
        problems = []
        listed = set()
        for p in self.patches:
            listed.add(p.file)
            path = self.patch_dir / p.file
            if not path.exists():
                problems.append(f"{p.file}: listed in the manifest but missing from patches/")
            elif (digest := sha256_file(path)) != p.sha256:
                problems.append(
                    f"{p.file}: sha256 {digest} differs from the manifest's {p.sha256} "
                    "(run `python -m dgr.vendor pin` after editing a patch)"
                )
        for path in sorted(self.patch_dir.glob("[0-9][0-9][0-9][0-9]-*.patch")):
            if path.name not in listed:
                problems.append(f"{path.name}: in patches/ but not listed in vendor-manifest.json")
        return problems

    def patch(self) -> Path:
        """Apply ``patches/NNNN-*.patch`` in manifest order; stop at the first that fails."""
        stamp = self._read_stamp("patch")
        if stamp and stamp.get("patches") == [p.file for p in self.patches]:
            return self.src
        # Patch only a freshly unpacked tree, so an interrupted run never leaves half a stack.
        self._stamp("fetch").unlink(missing_ok=True)
        self.fetch()
        problems = self.check_patches()
        if problems:
            raise VendorError("patch stack does not match the manifest:\n  " + "\n  ".join(problems))
        git = shutil.which("git")
        for i, p in enumerate(self.patches, 1):
            path = self.patch_dir / p.file
            _say(f"applying patch {i}/{len(self.patches)}: {p.file}")
            if git:
                cmd = [git, "apply", "--whitespace=nowarn", "-p1", str(path)]
            else:
                cmd = ["patch", "-p1", "--forward", "--batch", "-i", str(path)]
            proc = subprocess.run(cmd, cwd=self.src, capture_output=True, text=True)
            if proc.returncode != 0:
                # a half-patched tree must not be reused
                self._stamp("fetch").unlink(missing_ok=True)
                raise VendorError(
                    f"patch {p.file} does not apply to llama.cpp {self.commit[:12]}:\n"
                    f"{(proc.stderr or proc.stdout)[-2000:]}"
                )
        self._write_stamp("patch", {"patches": [p.file for p in self.patches],
                                    "patch_stack_hash": self.patch_stack_hash()})
        return self.src

    # -- build ----------------------------------------------------------------------

    def _cmake(self) -> str:
        cmake = shutil.which("cmake")
        if cmake is None:
            raise VendorError("cmake not found: `pip install cmake ninja` or install it from your OS")
        return cmake

    def configure(self) -> None:
        cmake = self._cmake()
        ninja = shutil.which("ninja")
        gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        cache = self.build_dir / "CMakeCache.txt"
        if cache.exists():
            was_ninja = _cmake_var(cache.read_text(errors="replace"), "CMAKE_GENERATOR") == "Ninja"
            if was_ninja != bool(ninja):
                shutil.rmtree(self.build_dir)  # the generator changed: start the build dir over
        self._drop_stale_subbuilds()
        cmd = [cmake, "-S", str(self.src), "-B", str(self.build_dir), *gen,
               *self.cmake_options, *self.extra_cmake_args]
        _say("configuring: " + " ".join(shlex.quote(c) for c in cmd[1:]))
        try:
            self._run(cmd, "cmake configure")
        except VendorError as e:
            # A failed configure leaves a CMakeCache.txt without a build file: the next build
            # would take it for configured and fail on a missing build.ninja. Start over then.
            shutil.rmtree(self.build_dir, ignore_errors=True)
            need = PREREQUISITES.get(self.backend)
            missing = self.missing_prerequisites()
            hint = (f"\n(the {self.backend} build needs {need}"
                    + (f"; not found here: {'; '.join(missing)}" if missing else "") + ")")
            raise VendorError(f"{e}{hint if need else ''}") from None

    def check_prerequisites(self) -> None:
        """Refuse a backend whose toolchain this machine seems to lack, naming what to install
        (``missing_prerequisites``)."""
        missing = self.missing_prerequisites()
        if missing:
            raise VendorError(f"cannot build the {self.backend} backend here: missing "
                              f"{'; '.join(missing)}. It needs {PREREQUISITES[self.backend]}.")

    def missing_prerequisites(self) -> list[str]:
        """What this machine seems to lack for the backend, looked up where distributions
        and SDKs put it (advisory: cmake's own search may find more, so only a failed
        configure or a fallback list, ``vulkan,cpu``, acts on it)."""
        missing = []
        incs = ["/usr/include", "/usr/local/include"] + [
            os.path.join(os.environ[v], "include") for v in ("VULKAN_SDK", "CONDA_PREFIX")
            if os.environ.get(v)]
        if self.backend == "vulkan":
            if shutil.which("glslc") is None:
                missing.append("glslc (the GLSL to SPIR-V compiler)")
            if not any(Path(d, "vulkan", "vulkan.h").exists() for d in incs):
                missing.append("the Vulkan headers (vulkan/vulkan.h)")
            if not any(Path(d, *f).exists() for d in incs
                       for f in (("spirv", "unified1", "spirv.hpp"), ("spirv-headers", "spirv.hpp"),
                                 ("spirv.hpp",))):
                missing.append("the SPIR-V headers (spirv.hpp)")
        elif self.backend == "cuda":
            if shutil.which("nvcc") is None and not os.environ.get("CUDACXX"):
                missing.append("nvcc (put it on PATH or set CUDACXX)")
        elif self.backend == "rocm":
            if shutil.which("hipcc") is None and not os.environ.get("HIPCXX"):
                missing.append("hipcc (or set HIPCXX)")
        elif self.backend == "metal" and sys.platform != "darwin":
            missing.append("macOS (Metal exists only there)")
        return missing

    def _configured(self) -> bool:
        """A usable cmake cache: it exists and the programs it recorded are still there.

        ``pip install`` configures inside a temporary build environment whose cmake and ninja
        vanish afterwards; a later build (say of ``--tools``) must then configure again with the
        programs on PATH. Objects already built stay valid, so this costs seconds.
        """
        cache = self.build_dir / "CMakeCache.txt"
        if not cache.exists():
            return False
        if not any((self.build_dir / f).exists() for f in ("build.ninja", "Makefile")):
            return False  # an interrupted configure: no build file was generated
        return not _lost_programs(cache) and not self._stale_subbuilds()

    def _stale_subbuilds(self) -> list[Path]:
        """The build folders of external projects inside the build (the Vulkan backend's
        ``vulkan-shaders-gen``, configured by cmake at build time with a cache of its own)
        whose cache names a cmake or ninja that is gone, as ``pip install``'s leaves them."""
        return [c.parent for c in self.build_dir.glob("**/*-build/CMakeCache.txt")
                if _lost_programs(c)]

    def _drop_stale_subbuilds(self) -> None:
        """Remove each stale external project's build folder and its stamps, so the next build
        configures and builds it again with the programs on PATH (a few seconds)."""
        for b in self._stale_subbuilds():
            _say(f"{b.name}: configured with programs that are gone, building it again")
            shutil.rmtree(b, ignore_errors=True)
            shutil.rmtree(b.with_name(b.name[:-len("-build")] + "-stamp"), ignore_errors=True)

    def _run(self, cmd: list[str], what: str) -> None:
        """Run a build step, echoing ninja/make progress lines; keep the tail for errors."""
        tail: list[str] = []
        last = 0.0
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace") as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line)
                del tail[:-60]
                m = re.match(r"^\[(\d+)/(\d+)\]", line)
                now = time.monotonic()
                if m and (now - last > 5 or m.group(1) == m.group(2)):
                    _say(f"  {what}: {m.group(1)}/{m.group(2)} steps")
                    last = now
        if proc.returncode != 0:
            raise VendorError(f"{what} failed (exit {proc.returncode}):\n{''.join(tail)}")

    def jobs(self) -> int:
        return int(os.environ.get("DGR_BUILD_JOBS") or os.cpu_count() or 2)

    def build(self, tools: list[str] | None = None) -> Path:
        """Build the static libraries (and ``tools``); reuse a current build."""
        tools = list(tools or [])
        unknown = [t for t in tools if t not in self.known_tools]
        if unknown:
            raise VendorError(f"unknown tool(s) {unknown}; known: {self.known_tools}")
        stamp = self._read_stamp("build")
        have_tools = set(stamp.get("tools", [])) if stamp else set()
        if stamp and set(tools) <= have_tools and all(self.tool_path(t).exists() for t in tools):
            return self.build_dir
        self.patch()
        if not self._configured():
            self.configure()
        targets = self.targets + [t for t in tools if t not in self.targets]
        t0 = time.monotonic()
        _say(f"building {', '.join(targets)} with {self.jobs()} jobs (a cold build of libllama "
             "takes a few minutes on 2 cores)")
        self._run([self._cmake(), "--build", str(self.build_dir), "-j", str(self.jobs()),
                   "--target", *targets], "build")
        _say(f"built in {time.monotonic() - t0:.0f} s")
        missing = [str(p) for p in self.libraries() if not p.exists()]
        if missing:
            raise VendorError(f"build finished but libraries are missing: {missing}")
        self._write_stamp("build", {"targets": self.targets, "tools": sorted(have_tools | set(tools)),
                                    "backend": self.backend, "backends": self.built_backends(),
                                    "cmake_options": self.cmake_options,
                                    "cmake_args": self.extra_cmake_args,
                                    "compiler": _compiler_id()})
        return self.build_dir

    def is_built(self) -> bool:
        return self._read_stamp("build") is not None and all(p.exists() for p in self.libraries())

    def libraries(self) -> list[Path]:
        """Static archives to link, dependents before their dependencies."""
        b = self.build_dir
        # llama.cpp's common library (chat templates, tool-call formats and their parsers:
        # ``common/chat``), then llama itself
        common = [b / "common" / "libllama-common.a", b / "common" / "libllama-common-base.a"]
        # libmtmd: the tree's own image and audio encoders (``mmproj`` projectors)
        media = [b / "tools" / "mtmd" / "libmtmd.a", b / "vendor" / "hash" / "libvendor-hash.a"]
        libs = common + media + [b / "src" / "libllama.a", b / "ggml" / "src" / "libggml.a"]
        # backend archives (ggml-cpu, ggml-rpc, ggml-cuda, ...) sit between ggml and ggml-base
        backends = sorted(p for p in (b / "ggml" / "src").rglob("libggml-*.a")
                          if p.name != "libggml-base.a")
        return libs + backends + [b / "ggml" / "src" / "libggml-base.a"]

    def built_backends(self) -> list[str]:
        """The ggml backends the build made (their static archives), the CPU one first."""
        src = self.build_dir / "ggml" / "src"
        names = {p.name[len("libggml-"):-len(".a")] for p in src.rglob("libggml-*.a")}
        names -= {"base"}
        order = ["cpu", "vulkan", "cuda", "hip", "metal", "blas", "rpc"]
        return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))

    def include_dirs(self) -> list[Path]:
        return [self.src / "include", self.src / "ggml" / "include", self.src / "src",
                self.src / "common", self.src / "vendor", self.src / "tools" / "mtmd"]

    def tool_path(self, name: str) -> Path:
        return self.build_dir / "bin" / name

    def gguf_py(self) -> Path:
        """The pinned tree's gguf-py (its constants match the pinned loader).

        The patch stack does not touch gguf-py, so when this workspace is not unpacked yet
        (a different patch set or CMAKE_ARGS) only the gguf-py subtree of the pinned archive is
        extracted, into a directory keyed by the archive's sha256.
        """
        if (self.src / "gguf-py" / "gguf").is_dir():
            return self.src / "gguf-py"
        dest = self.cache / f"gguf-py-{self.source['sha256'][:12]}"
        if (dest / "gguf").is_dir():
            return dest
        self._download()
        if sha256_file(self.archive) != self.source["sha256"]:
            raise VendorError(f"{self.archive} does not match the pinned sha256")
        prefix = self.source["subpath"].rstrip("/") + "/gguf-py/"
        tmp = Path(tempfile.mkdtemp(prefix="gguf-py-", dir=self.cache))
        with tarfile.open(self.archive, "r:gz") as tar:
            for m in tar.getmembers():
                if m.name.startswith(prefix) and ".." not in Path(m.name).parts:
                    m.name = m.name[len(prefix):]
                    if m.name:
                        tar.extract(m, tmp, filter="data")
        try:
            tmp.replace(dest)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def link_args(self) -> list[str]:
        """System libraries the static archives need (read from the cmake cache)."""
        args = ["-lpthread", "-ldl", "-lm"]
        cache = self.build_dir / "CMakeCache.txt"
        text = cache.read_text(errors="replace") if cache.exists() else ""
        cached = functools.partial(_cmake_var, text)  # a CMakeCache variable's value
        if cached("GGML_OPENMP") == "ON" and "OpenMP_CXX_FLAGS" in text:
            args.insert(0, "-fopenmp")

        backends = self.built_backends()
        if "vulkan" in backends:
            lib = cached("Vulkan_LIBRARY")
            args[:0] = [lib] if lib and Path(lib).exists() else ["-lvulkan"]
        if "cuda" in backends:
            # FindCUDAToolkit caches each library's path (CUDAToolkit_LIBRARY_DIR is not
            # cached): link those, with the runtime's folder as rpath; the driver API (libcuda)
            # comes with the driver, and its stub lets a machine without one link
            libs = [cached(v) for v in ("CUDA_cudart_LIBRARY", "CUDA_CUDART", "CUDA_cublas_LIBRARY",
                                        "CUDA_cublasLt_LIBRARY", "CUDA_cuda_driver_LIBRARY")]
            found = [lib for lib in dict.fromkeys(libs) if lib and Path(lib).exists()]
            dirs = list(dict.fromkeys(str(Path(lib).parent) for lib in found))
            args[:0] = ([f"-L{d}" for d in dirs] + [f"-Wl,-rpath,{d}" for d in dirs
                                                     if not d.endswith("stubs")]
                        + (found or ["-lcudart", "-lcublas", "-lcublasLt", "-lcuda"]))
        if "cuda" in backends and cached("GGML_CUDA_NCCL") == "ON":
            # ggml-cuda links NCCL where its FindNCCL found both the header and the library
            lib, inc = cached("NCCL_LIBRARY"), cached("NCCL_INCLUDE_DIR")
            if lib and Path(lib).exists() and inc and not inc.endswith("NOTFOUND"):
                args[:0] = [lib, f"-Wl,-rpath,{Path(lib).parent}"]
        if cached("GGML_RPC_RDMA") == "ON":
            # ggml-rpc's RDMA transport: on by itself where cmake finds libibverbs
            lib = cached("RDMA_LIB")
            args[:0] = [lib] if lib and Path(lib).exists() else ["-libverbs"]
        if "hip" in backends:
            args[:0] = ["-L/opt/rocm/lib", "-Wl,-rpath,/opt/rocm/lib",
                        "-lamdhip64", "-lhipblas", "-lrocblas"]
        if "metal" in backends:
            args[:0] = ["-framework", "Foundation", "-framework", "Metal", "-framework", "MetalKit"]
        return args

    # -- reports --------------------------------------------------------------------

    def status(self) -> dict:
        return {
            "commit": self.commit,
            "source": f"{self.source['package']}=={self.source['version']} ({self.source['subpath']})",
            "patches": [p.file for p in self.patches],
            "patch_stack_hash": self.patch_stack_hash(),
            "key": self.key(),
            "cache": str(self.workspace),
            "fetched": self._read_stamp("fetch") is not None,
            "patched": self._read_stamp("patch") is not None,
            "built": self.is_built(),
            "backend": self.backend,
            "cpu_variant": self.cpu_variant_name,
            "backends_built": ", ".join(self.built_backends()) if self.is_built() else "",
            "tools": (self._read_stamp("build") or {}).get("tools", []),
            "current": self.is_built() and not self.check_patches(),
        }

    def verify(self) -> list[str]:
        """Everything that does not match the pin; empty when all is well."""
        problems = self.check_patches()
        if self.archive.exists():
            digest = sha256_file(self.archive)
            if digest != self.source["sha256"]:
                problems.append(f"{self.archive}: sha256 {digest} != {self.source['sha256']}")
        else:
            problems.append(f"{self.archive}: not downloaded (run `python -m dgr.vendor fetch`)")
        if not self.is_built():
            problems.append(f"{self.workspace}: not built (run `python -m dgr.vendor build`)")
        return problems

    def pin(self) -> list[Patch]:
        """Rewrite the manifest's patch list from ``patches/NNNN-*.patch`` (sorted)."""
        files = sorted(self.patch_dir.glob("[0-9][0-9][0-9][0-9]-*.patch"))
        self.manifest["patches"] = [{"file": f.name, "sha256": sha256_file(f)} for f in files]
        path = self.root / "vendor-manifest.json"
        path.write_text(json.dumps(self.manifest, indent=2) + "\n")
        self.patches = [Patch(p["file"], p["sha256"]) for p in self.manifest["patches"]]
        return self.patches
