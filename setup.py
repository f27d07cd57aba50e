"""Build dgr: fetch + patch + build the pinned llama.cpp, then compile cpp/ and dgr/_core/.

``pip install -e .`` runs everything. The llama.cpp build lives out of tree under
``$DGR_CACHE`` (default ``~/.cache/dgr``) keyed by manifest, patches, backend, cmake options and
compiler, so a second install reuses it. ``DGR_CPU_VARIANT`` picks the CPU code: ``native`` (the
default: this CPU's instruction sets) or ``x86-64-v3`` (the portable baseline of a wheel; see
``dgr.vendor.CPU_VARIANTS``). ``DGR_BACKEND`` (cpu, vulkan, cuda, rocm, metal) picks
the ggml backend built beside the CPU one; the choice is recorded in ``dgr/_core/backend.txt``
so later builds and the tools of this checkout use the same one. ``CMAKE_ARGS`` passes through
to cmake (e.g. ``-DCMAKE_CUDA_ARCHITECTURES=native``).
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _load_vendor():
    # Import dgr/vendor/ (stdlib only) without importing the dgr package itself.
    pkg = importlib.util.spec_from_file_location("dgr", ROOT / "dgr" / "__init__.py",
                                                 submodule_search_locations=[str(ROOT / "dgr")])
    mod = importlib.util.module_from_spec(pkg)
    sys.modules.setdefault("dgr", mod)
    from dgr import vendor  # noqa: E402  (loads dgr.errors and dgr.vendor only)
    return vendor


class BuildExt(build_ext):
    """Runs the vendor pipeline before compiling, and points the extension at its outputs."""

    def build_extensions(self):
        vendor = _load_vendor()
        v = vendor.Vendor(ROOT)
        v.build()
        (ROOT / vendor.BACKEND_RECORD).write_text(v.backend + "\n")
        built = v.built_backends()
        llama_h = (v.src / "include" / "llama.h").read_text()
        has_ranges = "llama_model_layer_start" in llama_h
        import numpy

        cpu = [("DGR_CPU_VARIANT", f'"{v.cpu_variant_name}"'),
               ("DGR_CPU_REQUIRES", f'"{",".join(v.cpu_requires())}"')]
        for ext in self.extensions:
            ext.define_macros += cpu
            if ext.name == "dgr._cpu._cpu":  # the CPU check: no llama.cpp, no -march, no OpenMP
                continue
            ext.include_dirs += [str(ROOT / "cpp" / "include"), numpy.get_include(),
                                 *map(str, v.include_dirs()),
                                 str(v.src / "vendor" / "hash")]  # xxhash/xxhash.h (frame.cpp)
            # static archives: dependents before their dependencies
            ext.extra_objects += [str(p) for p in v.libraries()]
            ext.extra_link_args += v.link_args()
            if sys.platform != "darwin":  # GNU ld and lld (Apple's ld has no such option)
                # each module keeps its copy of llama.cpp to itself: the archives' symbols are
                # not exported, so two modules' copies (the engine's, the chat binding's) never
                # bind to each other (an inline function's static is otherwise one for both)
                ext.extra_link_args.append("-Wl,--exclude-libs,ALL")
            ext.define_macros += [("DGR_LAYER_RANGE", "1" if has_ranges else "0"),
                                  ("DGR_LLAMA_COMMIT", f'"{v.commit}"'),
                                  ("DGR_PATCH_STACK_HASH", f'"{v.patch_stack_hash()}"'),
                                  ("DGR_VENDOR_KEY", f'"{v.key()}"'),
                                  ("DGR_WITH_VULKAN", "1" if "vulkan" in built else "0"),
                                  ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
            ext.extra_compile_args += ["-std=c++17", "-O2", "-fvisibility=hidden"]
            if "-fopenmp" in v.link_args():
                ext.extra_compile_args.append("-fopenmp")
        super().build_extensions()


# dgr::Engine's bodies, one file per concern (cpp/src/engine/impl.h says which holds what)
_ENGINE_PARTS = [f"cpp/src/engine/{name}.cpp"
                 for name in ("support", "devices", "load", "memory", "forward", "mtp")]


def _extensions():
    from Cython.Build import cythonize

    ext = Extension(
        "dgr._core._core",
        sources=["dgr/_core/_core.pyx", "cpp/src/engine.cpp", *_ENGINE_PARTS, "cpp/src/media.cpp"],
        language="c++",
        depends=["cpp/include/dgr/engine.h", "cpp/include/dgr/status.h", "cpp/src/engine/impl.h",
                 "cpp/include/dgr/build_info.h",
                 "dgr/_core/includes/engine.pxd", "dgr/_core/_media.pxi",
                 "cpp/include/dgr/media.h", "vendor-manifest.json"],
    )
    frame = Extension(  # the wire frame codec: no llama.cpp symbols, but built the same way
        "dgr._core._frame",
        sources=["dgr/_core/_frame.pyx", "cpp/src/frame.cpp", "cpp/src/frame_xxh3_avx2.cpp",
                 "cpp/src/frame_io.cpp"],
        language="c++",
        depends=["cpp/include/dgr/frame.h", "cpp/include/dgr/frame_io.h", "cpp/include/dgr/status.h",
                 "dgr/_core/includes/frame.pxd"],
    )
    chat = Extension(  # llama.cpp's chat templates and tool-call parsers (common/chat)
        "dgr._chat._chat",
        sources=["dgr/_chat/_chat.pyx", "cpp/src/chat.cpp"],
        language="c++",
        depends=["cpp/include/dgr/chat.h", "vendor-manifest.json"],
    )
    cpu = Extension(  # which CPU code the build holds, checked before the others load
        "dgr._cpu._cpu", sources=["dgr/_cpu/_cpu.pyx"], language="c++",
        depends=["vendor-manifest.json"])
    return cythonize([ext, frame, chat, cpu], language_level=3,
                     compiler_directives={"embedsignature": True},
                     annotate=bool(os.environ.get("DGR_CYTHON_ANNOTATE")))


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
