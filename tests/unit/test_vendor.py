"""The vendor pipeline on a fake pinned archive: sha256 check, ordered patches, stamps, keys."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from dgr import errors
from dgr.vendor import Vendor
from dgr.vendor.cli import main

SUB = "pkg-1.0/vendor/llama.cpp"


def _tarball(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{SUB}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        # something outside the subtree that must not be unpacked
        info = tarfile.TarInfo("pkg-1.0/setup.py")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"x=1"))
    return buf.getvalue()


PATCH_OK = """\
--- a/hello.txt
+++ b/hello.txt
@@ -1 +1 @@
-hello
+hello, patched
"""

PATCH_BAD = """\
--- a/hello.txt
+++ b/hello.txt
@@ -1 +1 @@
-this line is not there
+nope
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "patches").mkdir(parents=True)
    archive = _tarball({"hello.txt": "hello\n", ".git": "gitdir: ../../x\n"})
    manifest = {
        "manifest_version": 1,
        "llama_cpp": {"commit": "0" * 40, "source": {
            "kind": "pypi-sdist", "package": "pkg", "version": "1.0",
            "filename": "pkg-1.0.tar.gz", "sha256": hashlib.sha256(archive).hexdigest(),
            "subpath": SUB}},
        "patches": [],
        "cmake": {"options": ["-DX=1"], "targets": ["llama"], "tools": ["llama-simple"]},
    }
    (root / "vendor-manifest.json").write_text(json.dumps(manifest))
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / "pkg-1.0.tar.gz").write_bytes(archive)
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.delenv("DGR_CPU_VARIANT", raising=False)
    return root, cache


def _add_patch(root: Path, name: str, text: str) -> None:
    (root / "patches" / name).write_text(text)
    Vendor(root, root.parent / "cache").pin()


def test_fetch_unpacks_only_the_subtree_and_drops_the_git_file(fake):
    root, cache = fake
    v = Vendor(root, cache)
    src = v.fetch()
    assert (src / "hello.txt").read_text() == "hello\n"
    assert not (src / ".git").exists()
    assert not (src / "setup.py").exists()
    assert str(src).startswith(str(cache))


def test_fetch_refuses_an_archive_with_the_wrong_sha256(fake, monkeypatch):
    root, cache = fake
    (cache / "downloads" / "pkg-1.0.tar.gz").write_bytes(_tarball({"hello.txt": "evil\n"}))
    v = Vendor(root, cache)
    # a download that "succeeds" with the wrong bytes (no network in unit tests)
    monkeypatch.setattr(Vendor, "_download", lambda self: None)
    with pytest.raises(errors.VendorError, match="refusing to unpack"):
        v.fetch()
    assert not v.src.exists()


def test_patches_apply_in_order(fake):
    root, cache = fake
    _add_patch(root, "0001-hello.patch", PATCH_OK)
    v = Vendor(root, cache)
    v.patch()
    assert (v.src / "hello.txt").read_text() == "hello, patched\n"
    # a second call reuses the stamped tree (does not apply twice)
    v.patch()
    assert (v.src / "hello.txt").read_text() == "hello, patched\n"


def test_a_patch_that_does_not_apply_stops_with_its_name(fake):
    root, cache = fake
    _add_patch(root, "0001-hello.patch", PATCH_OK)
    _add_patch(root, "0002-broken.patch", PATCH_BAD)
    v = Vendor(root, cache)
    with pytest.raises(errors.VendorError, match="0002-broken.patch"):
        v.patch()
    assert not v.is_built()


def test_edited_patch_is_caught_by_its_sha256(fake):
    root, cache = fake
    _add_patch(root, "0001-hello.patch", PATCH_OK)
    (root / "patches" / "0001-hello.patch").write_text(PATCH_OK.replace("patched", "edited"))
    v = Vendor(root, cache)
    assert any("0001-hello.patch" in p and "sha256" in p for p in v.check_patches())
    with pytest.raises(errors.VendorError, match="0001-hello.patch"):
        v.patch()


def test_unlisted_patch_is_reported(fake):
    root, cache = fake
    (root / "patches" / "0009-stray.patch").write_text(PATCH_OK)
    assert any("0009-stray.patch" in p for p in Vendor(root, cache).check_patches())


def test_key_changes_with_patches_and_cmake_args(fake, monkeypatch):
    root, cache = fake
    k0 = Vendor(root, cache).key()
    _add_patch(root, "0001-hello.patch", PATCH_OK)
    k1 = Vendor(root, cache).key()
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=ON")
    k2 = Vendor(root, cache).key()
    assert len({k0, k1, k2}) == 3
    assert Vendor(root, cache).workspace.name == f"llama.cpp-{k2}"


def test_a_native_build_is_keyed_by_the_cpus_instruction_sets(fake, monkeypatch):
    """ggml builds with -march=native by default: a cache shared by hosts of different CPUs
    (a home directory on NFS, a restored CI cache) must not hand an AMX build to a CPU
    without AMX. A portable build (-DGGML_NATIVE=OFF) runs anywhere: one key for all."""
    import dgr.vendor.cpu as vendor

    root, cache = fake

    def key_on(isa: tuple[str, ...]) -> str:
        monkeypatch.setattr(vendor, "cpu_features", lambda: ("a cpu", isa, isa))
        return Vendor(root, cache).key()

    avx2, amx = ("avx", "avx2", "fma"), ("amx_int8", "amx_tile", "avx", "avx2", "fma")
    assert key_on(avx2) != key_on(amx)
    assert key_on(amx) == key_on(amx)
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_NATIVE=OFF")
    assert key_on(avx2) == key_on(amx)


def test_the_portable_variant_builds_the_x86_64_v3_baseline_in_its_own_workspace(
        fake, monkeypatch):
    """DGR_CPU_VARIANT=x86-64-v3 (a wheel's): ggml's native build off, the baseline's
    instruction sets on and nothing above them, one key for every host CPU, another than the
    native build's; the compiled core is told what to check at import."""
    import dgr.vendor.cpu as vendor

    root, cache = fake
    monkeypatch.setattr(vendor.platform, "machine", lambda: "x86_64")
    native = Vendor(root, cache)
    assert (native.cpu_variant, native.cpu_variant_name, native.cpu_requires()) == (
        "native", "native", ())
    monkeypatch.setenv("DGR_CPU_VARIANT", "x86-64-v3")

    def on(isa):
        monkeypatch.setattr(vendor, "cpu_features", lambda: ("a cpu", isa, isa))
        return Vendor(root, cache)

    v = on(("avx", "avx2", "fma"))
    assert v.key() == on(("amx_tile", "avx", "avx2", "avx512f", "fma")).key() != native.key()
    opts = v.cmake_options
    assert opts[:1] == ["-DX=1"] and "-DGGML_NATIVE=OFF" in opts
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
            "-DGGML_AVX512=OFF"} <= set(opts)
    assert v.cpu_variant_name == "x86-64-v3" and v.status()["cpu_variant"] == "x86-64-v3"
    assert v.cpu_requires() == ("sse4.2", "avx", "avx2", "fma", "f16c", "bmi2")
    # CMAKE_ARGS turning the native build off by itself: a build of its own, named custom
    monkeypatch.delenv("DGR_CPU_VARIANT")
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_NATIVE=OFF")
    assert Vendor(root, cache).cpu_variant_name == "custom"


def test_an_unknown_or_foreign_cpu_variant_is_refused(fake, monkeypatch):
    import dgr.vendor.cpu as vendor

    root, cache = fake
    monkeypatch.setenv("DGR_CPU_VARIANT", "x86-64-v4")
    with pytest.raises(errors.VendorError, match="unknown CPU variant 'x86-64-v4'.*native"):
        Vendor(root, cache)
    monkeypatch.setenv("DGR_CPU_VARIANT", "x86-64-v3")
    monkeypatch.setattr(vendor.platform, "machine", lambda: "aarch64")
    with pytest.raises(errors.VendorError, match="for x86-64; this machine is aarch64"):
        Vendor(root, cache)


def test_an_installed_package_without_the_tree_says_where_it_is(tmp_path):
    with pytest.raises(errors.VendorError, match="installed package.*source checkout"):
        Vendor(tmp_path / "site-packages", tmp_path / "cache")


def test_dgr_cache_env_moves_the_workspace(fake, monkeypatch, tmp_path):
    root, _ = fake
    monkeypatch.setenv("DGR_CACHE", str(tmp_path / "elsewhere"))
    assert Vendor(root).workspace.parent == tmp_path / "elsewhere"


def test_unknown_tool_is_refused(fake):
    root, cache = fake
    with pytest.raises(errors.VendorError, match="unknown tool"):
        Vendor(root, cache).build(tools=["rm-rf"])


def test_status_and_verify_report_state(fake):
    root, cache = fake
    v = Vendor(root, cache)
    st = v.status()
    assert st["commit"] == "0" * 40 and st["cache"] == str(v.workspace)
    assert st["built"] is False and st["current"] is False
    problems = v.verify()
    assert any("not built" in p for p in problems)


def test_real_manifest_is_consistent():
    """The repository's own manifest: pinned commit, sha256, every patch listed and matching."""
    v = Vendor()
    assert v.commit == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert v.source["sha256"] == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert v.check_patches() == []


def test_cli_status_runs(capsys):
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "0c1e57098bba43ac29e6e3b677cdceebdd22334f" in out and "patch_stack_hash" in out


# -- backends: one workspace each, prerequisites named, no stale state after a failed configure

def test_each_backend_builds_in_its_own_workspace(fake, monkeypatch):
    root, cache = fake
    monkeypatch.delenv("DGR_BACKEND", raising=False)
    keys = {b: Vendor(root, cache, backend=b).key() for b in ("cpu", "vulkan", "cuda")}
    assert len(set(keys.values())) == 3
    assert Vendor(root, cache).key() == keys["cpu"]  # the default is the CPU build
    v = Vendor(root, cache, backend="vulkan")
    assert "-DGGML_VULKAN=ON" in v.cmake_options
    assert "-DGGML_VULKAN=ON" not in Vendor(root, cache, backend="cpu").cmake_options


def test_the_backend_comes_from_the_environment_then_the_last_build_of_the_checkout(
        fake, monkeypatch):
    root, cache = fake
    monkeypatch.delenv("DGR_BACKEND", raising=False)
    assert Vendor(root, cache).backend == "cpu"
    record = root / "dgr" / "_core" / "backend.txt"
    record.parent.mkdir(parents=True)
    record.write_text("vulkan\n")  # what setup.py writes after building the core
    assert Vendor(root, cache).backend == "vulkan"
    monkeypatch.setenv("DGR_BACKEND", "cuda")
    assert Vendor(root, cache).backend == "cuda"
    assert Vendor(root, cache, backend="cpu").backend == "cpu"


def test_an_unknown_backend_is_refused(fake, monkeypatch):
    root, cache = fake
    monkeypatch.setenv("DGR_BACKEND", "opencl")
    with pytest.raises(errors.VendorError, match="unknown backend 'opencl'.*vulkan"):
        Vendor(root, cache)
    assert main(["status", "--backend", "cpu"]) == 0  # an explicit one wins over the env


def test_a_missing_toolchain_is_named_and_a_preference_list_passes_over_it(fake, monkeypatch,
                                                                          capsys):
    root, cache = fake
    import dgr.vendor as vendor

    monkeypatch.setattr(vendor.shutil, "which", lambda name: None)
    v = Vendor(root, cache, backend="vulkan")
    with pytest.raises(errors.VendorError, match="glslc.*libvulkan-dev glslc spirv-headers"):
        v.check_prerequisites()
    with pytest.raises(errors.VendorError, match="nvcc"):
        Vendor(root, cache, backend="cuda").check_prerequisites()
    # vulkan,cpu: the first this machine can build, said on stderr
    monkeypatch.setenv("DGR_BACKEND", "vulkan,cpu")
    assert Vendor(root, cache).backend == "cpu"
    assert "not building the vulkan backend" in capsys.readouterr().err
    monkeypatch.setattr(vendor.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(Vendor, "missing_prerequisites", lambda self: [])
    assert Vendor(root, cache).backend == "vulkan"


def test_a_failed_configure_leaves_nothing_the_next_build_trips_over(fake, monkeypatch):
    root, cache = fake
    v = Vendor(root, cache, backend="cpu")
    v.build_dir.mkdir(parents=True)
    monkeypatch.setattr(Vendor, "_cmake", lambda self: "cmake")

    def configure_fails(self, cmd, what):
        # what an aborted cmake run leaves: a cache, and no build file
        (self.build_dir / "CMakeCache.txt").write_text("CMAKE_GENERATOR:INTERNAL=Ninja\n")
        raise errors.VendorError(f"{what} failed (exit 1): Could NOT find SPIRV-Headers")

    monkeypatch.setattr(Vendor, "_run", configure_fails)
    with pytest.raises(errors.VendorError, match="SPIRV-Headers"):
        v.configure()
    assert not v.build_dir.exists()
    assert not v._configured()
    # a cache without a build file (a configure killed midway) is not a configured build
    v.build_dir.mkdir(parents=True)
    (v.build_dir / "CMakeCache.txt").write_text("CMAKE_GENERATOR:INTERNAL=Ninja\n")
    assert not v._configured()
    (v.build_dir / "build.ninja").write_text("")
    assert v._configured()


def _built_archives(v: Vendor, backend: str) -> None:
    """The static archives a build with ``backend`` leaves (empty files)."""
    src = v.build_dir / "ggml" / "src"
    for name in ("libggml-base.a", "ggml-cpu/libggml-cpu.a",
                 f"ggml-{backend}/libggml-{backend}.a"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(b"")


def test_the_link_takes_the_libraries_of_the_backends_the_build_made(fake):
    root, cache = fake
    v = Vendor(root, cache, backend="vulkan")
    _built_archives(v, "vulkan")
    (v.build_dir / "CMakeCache.txt").write_text("GGML_OPENMP:BOOL=OFF\n")
    assert v.built_backends() == ["cpu", "vulkan"]
    assert "-lvulkan" in v.link_args()
    assert "-lvulkan" not in Vendor(root, cache, backend="cpu").link_args()


# -- the prepared source archive: the pinned tree without a package registry -----------------

def test_a_prepared_archive_is_the_pinned_tree_less_what_no_build_needs(fake, tmp_path,
                                                                        monkeypatch):
    root, cache = fake
    archive = _tarball({"hello.txt": "hello\n", "docs/big.md": "x" * 1000,
                        "models/ggml-vocab.gguf": "v", "src/a.c": "int a;\n"})
    (cache / "downloads" / "pkg-1.0.tar.gz").write_bytes(archive)
    m = json.loads((root / "vendor-manifest.json").read_text())
    m["llama_cpp"]["source"]["sha256"] = hashlib.sha256(archive).hexdigest()
    (root / "vendor-manifest.json").write_text(json.dumps(m))
    key = Vendor(root, cache).key()
    out, tree = Vendor(root, cache).pack(tmp_path / "prepared.tar.gz")
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["hello.txt", "src/a.c"]
    again, tree2 = Vendor(root, cache).pack(tmp_path / "again.tar.gz")
    assert tree2 == tree and again.read_bytes() == out.read_bytes()  # reproducible
    # pinned: a build unpacks it with no download, and the pin does not change the key
    m["prepared"] = {"exclude": ["docs", "models"], "tree_sha256": tree}
    (root / "vendor-manifest.json").write_text(json.dumps(m))
    assert Vendor(root, cache).key() == key
    monkeypatch.setattr(Vendor, "_download", lambda self: pytest.fail("downloaded"))
    monkeypatch.setenv("DGR_VENDOR_ARCHIVE", str(out))
    other = tmp_path / "other-cache"
    src = Vendor(root, other).fetch()
    assert (src / "src" / "a.c").read_text() == "int a;\n" and not (src / "docs").exists()


def test_a_prepared_archive_that_is_not_the_pinned_tree_is_refused(fake, tmp_path,
                                                                   monkeypatch):
    root, cache = fake
    out, tree = Vendor(root, cache).pack(tmp_path / "prepared.tar.gz")
    m = json.loads((root / "vendor-manifest.json").read_text())
    m["prepared"] = {"tree_sha256": tree}
    (root / "vendor-manifest.json").write_text(json.dumps(m))
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        data = b"hello, tampered\n"
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    monkeypatch.setenv("DGR_VENDOR_ARCHIVE", str(evil))
    v = Vendor(root, tmp_path / "c2")
    with pytest.raises(errors.VendorError, match="refusing to build from it"):
        v.fetch()
    assert not v.src.exists()


def test_the_real_manifest_pins_the_prepared_tree():
    v = Vendor()
    pin = v.manifest["prepared"]
    assert len(pin["tree_sha256"]) == 64 and "docs" in pin["exclude"]


def test_a_cuda_build_links_the_libraries_its_cmake_cache_found(fake, tmp_path):
    root, cache = fake
    v = Vendor(root, cache, backend="cuda")
    _built_archives(v, "cuda")
    lib = tmp_path / "cuda" / "lib64"
    (lib / "stubs").mkdir(parents=True)
    for f in ("libcudart.so", "libcublas.so", "libcublasLt.so", "stubs/libcuda.so"):
        (lib / f).write_bytes(b"")
    (v.build_dir / "CMakeCache.txt").write_text(
        f"CUDA_cudart_LIBRARY:FILEPATH={lib}/libcudart.so\n"
        f"CUDA_cublas_LIBRARY:FILEPATH={lib}/libcublas.so\n"
        f"CUDA_cublasLt_LIBRARY:FILEPATH={lib}/libcublasLt.so\n"
        f"CUDA_cuda_driver_LIBRARY:FILEPATH={lib}/stubs/libcuda.so\n")
    args = v.link_args()
    assert f"{lib}/libcublas.so" in args and f"{lib}/stubs/libcuda.so" in args
    assert f"-Wl,-rpath,{lib}" in args and f"-Wl,-rpath,{lib}/stubs" not in args


def test_a_build_links_nccl_and_ibverbs_where_its_cmake_found_them(fake, tmp_path):
    """On a machine with NCCL and libibverbs (the lent H200), ggml-cuda and ggml-rpc turn them
    on by themselves; the extension then failed to import (undefined symbol ibv_dereg_mr,
    then ncclAllReduce) until both were linked."""
    root, cache = fake
    v = Vendor(root, cache, backend="cuda")
    _built_archives(v, "cuda")
    lib = tmp_path / "sys"
    lib.mkdir()
    for f in ("libnccl.so", "libibverbs.so"):
        (lib / f).write_bytes(b"")
    cache_file = v.build_dir / "CMakeCache.txt"
    cache_file.write_text(
        f"GGML_CUDA_NCCL:BOOL=ON\nNCCL_LIBRARY:FILEPATH={lib}/libnccl.so\n"
        f"NCCL_INCLUDE_DIR:PATH=/usr/include\nGGML_RPC_RDMA:BOOL=ON\n"
        f"RDMA_LIB:FILEPATH={lib}/libibverbs.so\n")
    args = v.link_args()
    assert f"{lib}/libnccl.so" in args and f"-Wl,-rpath,{lib}" in args
    assert f"{lib}/libibverbs.so" in args
    # not found, or turned off: not linked
    cache_file.write_text(
        "GGML_CUDA_NCCL:BOOL=ON\nNCCL_LIBRARY:FILEPATH=NCCL_LIBRARY-NOTFOUND\n"
        "NCCL_INCLUDE_DIR:PATH=NCCL_INCLUDE_DIR-NOTFOUND\nGGML_RPC_RDMA:BOOL=OFF\n"
        "RDMA_LIB:FILEPATH=RDMA_LIB-NOTFOUND\n")
    args = v.link_args()
    assert not any("nccl" in a or "ibverbs" in a for a in args), args


def test_an_external_projects_build_left_by_pip_is_configured_again(fake, monkeypatch, tmp_path):
    """pip install configures in a build environment whose cmake and ninja vanish; the Vulkan
    backend's vulkan-shaders-gen is an external project with a cache of its own, naming them.
    A later build (say of --tools) must not run that project's configure with the lost ninja
    (it failed: "ninja --version ... no such file or directory"): the stale project's build
    folder and stamps are dropped, so it is configured and built again."""
    root, cache = fake
    v = Vendor(root, cache, backend="vulkan")
    here = tmp_path / "programs"
    here.mkdir()
    for p in ("cmake", "ninja"):
        (here / p).write_text("")

    def cache_text(programs):
        return (f"CMAKE_GENERATOR:INTERNAL=Ninja\nCMAKE_MAKE_PROGRAM:FILEPATH={programs}/ninja\n"
                f"CMAKE_COMMAND:INTERNAL={programs}/cmake\n")

    v.build_dir.mkdir(parents=True)
    (v.build_dir / "CMakeCache.txt").write_text(cache_text(here))
    (v.build_dir / "build.ninja").write_text("")
    prefix = v.build_dir / "ggml/src/ggml-vulkan/vulkan-shaders-gen-prefix/src"
    sub, stamp = prefix / "vulkan-shaders-gen-build", prefix / "vulkan-shaders-gen-stamp"
    sub.mkdir(parents=True)
    stamp.mkdir()
    (sub / "CMakeCache.txt").write_text(cache_text(here))
    assert v._configured()
    (sub / "CMakeCache.txt").write_text(cache_text(tmp_path / "pip-build-env-gone"))
    assert not v._configured()

    ran = []
    monkeypatch.setattr(Vendor, "_cmake", lambda self: str(here / "cmake"))
    monkeypatch.setattr(Vendor, "_run", lambda self, cmd, what: ran.append(what))
    v.configure()
    assert ran == ["cmake configure"]
    assert not sub.exists() and not stamp.exists()
    assert (v.build_dir / "CMakeCache.txt").exists()  # the top build keeps what it built
    assert v._configured()
