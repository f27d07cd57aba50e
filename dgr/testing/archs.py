"""Tiny random GGUF models for (nearly) every architecture, from upstream's own generator.

The pinned llama.cpp ships ``tests/test-llama-archs.cpp``; with ``-a REGEX -o DIR`` it builds
a random dense and/or MoE model per matching architecture (``<arch>-dense.gguf``,
``<arch>-moe.gguf``) through ``llama_model_init_from_user`` and saves it with
``llama_model_saver``. The vendor build has tests off, so this module compiles the file
itself, once per vendor key, into ``$DGR_CACHE/archs-<key>/`` (never into the repository),
against the cached static libraries (``libllama-common`` included, which any of the vendor
tools pulls in).

Two documented source tweaks are applied to a copy of the file before compiling
(:data:`TWEAKS`; each anchor must match exactly once, or the build stops with a
:class:`~dgr.errors.VendorError`):

1. ``uint32_t n_layer = 2;`` (the default for most architectures) becomes
   ``$DGR_ARCHS_N_LAYER``, else :data:`N_LAYER` (4), so every fixture has a first, a middle
   and a last stage (``write(..., n_layer=8)`` writes deeper ones, for splits of 3 stages of
   several layers each). The per-layer hparams arrays the generator writes are built in loops
   over ``n_layer``, so they follow; architectures with their own count (llama4 4, deepseek4
   4, nemotron_h 3, gemma3n 22, ...) keep it.
2. Saving one model is wrapped in ``try``/``catch``: an architecture whose hparams do not
   fit the new layer count (upstream throws, which ends the whole run) is reported on stderr
   as ``DGR_ARCHS_FAILED <arch> <dense|moe>: <why>`` and the run goes on with the next.

The seed is fixed (:data:`SEED`), so the same vendor key always writes the same bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dgr.errors import VendorError

__all__ = ["N_LAYER", "PROBE_SETTINGS", "SEED", "TWEAKS", "Written", "arch_of", "format_table",
           "generator", "probe", "probe_all", "tweaked_source", "write"]

N_LAYER = 4
#: the generator's default layer count, read at run time (``write``'s ``n_layer``)
N_LAYER_ENV = ('std::getenv("DGR_ARCHS_N_LAYER") ? (uint32_t) std::atoi(std::getenv('
               f'"DGR_ARCHS_N_LAYER")) : {N_LAYER}')
SEED = 1234
GENERATOR_SOURCE = "tests/test-llama-archs.cpp"
FAILED_TAG = "DGR_ARCHS_FAILED"

_SAVE_OLD = """\
            auto model_and_ctx = get_model_and_ctx(gguf_ctx.get(), nullptr, seed, stdev, {});
            const std::string path = dir + "/" + llm_arch_name(arch) + (moe ? "-moe.gguf" : "-dense.gguf");
            LOG_INF("%s: Saving %s model (%s) to %s...\\n", __func__, llm_arch_name(arch), moe ? "MoE" : "dense", path.c_str());
            llama_model_save_to_file(model_and_ctx.first.get(), path.c_str());
"""
_SAVE_NEW = """\
            try {
                auto model_and_ctx = get_model_and_ctx(gguf_ctx.get(), nullptr, seed, stdev, {});
                const std::string path = dir + "/" + llm_arch_name(arch) + (moe ? "-moe.gguf" : "-dense.gguf");
                LOG_INF("%s: Saving %s model (%s) to %s...\\n", __func__, llm_arch_name(arch), moe ? "MoE" : "dense", path.c_str());
                llama_model_save_to_file(model_and_ctx.first.get(), path.c_str());
            } catch (const std::exception & err) {
                fprintf(stderr, "FAILED_TAG %s %s: %s\\n", llm_arch_name(arch), moe ? "moe" : "dense", err.what());
            }
""".replace("FAILED_TAG", FAILED_TAG)

#: upstream skips the RWKV family ("FIXME RWKV models hang indefinitely"); RWKV-6, RWKV-7 and
#: ARWKV-7 load and run here once given the hyperparameters they need (:data:`_RWKV_HPARAMS_NEW`).
#: RWKV6-Qwen2 stays skipped: its fixture would crash the whole run
_RWKV_SKIP_OLD = """\
    if (arch == LLM_ARCH_RWKV6 || arch == LLM_ARCH_RWKV6QWEN2 || arch == LLM_ARCH_RWKV7 || arch == LLM_ARCH_ARWKV7) {
        return false; // FIXME RWKV models hang indefinitely.
    }
"""
_RWKV_SKIP_NEW = """\
    if (arch == LLM_ARCH_RWKV6QWEN2) {
        return false; // dgr: the generator gives it the optional time_mix_first, which QRWKV6 files lack, and its graph then reads an absent time_mix_ln (a segfault)
    }
"""
_RWKV_HPARAMS_OLD = """\
    if (arch == LLM_ARCH_MAPLE) {
        ms.add_kv(LLM_KV_SWIGLU_CLAMP_EXP, 7.0f);
    }
"""
#: RWKV-7's LoRA ranks (required keys); ARWKV-7 shifts one token (its graph asserts
#: ``n_embd == n_embd_r()``, so ``token_shift_count`` is 1, not the default 2)
_RWKV_HPARAMS_NEW = _RWKV_HPARAMS_OLD + """\
    // dgr: the RWKV family's hyperparameters
    if (arch == LLM_ARCH_RWKV7 || arch == LLM_ARCH_ARWKV7) {
        ms.add_kv(LLM_KV_ATTENTION_DECAY_LORA_RANK,              uint32_t(16));
        ms.add_kv(LLM_KV_ATTENTION_ICLR_LORA_RANK,               uint32_t(16));
        ms.add_kv(LLM_KV_ATTENTION_VALUE_RESIDUAL_MIX_LORA_RANK, uint32_t(16));
        ms.add_kv(LLM_KV_ATTENTION_GATE_LORA_RANK,               uint32_t(16));
    }
    if (arch == LLM_ARCH_ARWKV7) {
        ms.add_kv(LLM_KV_TOKEN_SHIFT_COUNT, uint32_t(1));
    }
"""

#: (anchor, replacement) pairs applied to upstream's source, each anchor exactly once
TWEAKS: tuple[tuple[str, str], ...] = (
    ("    uint32_t n_layer = 2;\n",
     f'    uint32_t n_layer = {N_LAYER_ENV}; // dgr: was 2\n'),
    (_SAVE_OLD, _SAVE_NEW),
    (_RWKV_SKIP_OLD, _RWKV_SKIP_NEW),
    (_RWKV_HPARAMS_OLD, _RWKV_HPARAMS_NEW),
)


def _say(msg: str) -> None:
    print(f"[dgr.testing.archs] {msg}", file=sys.stderr, flush=True)


def tweaked_source(text: str) -> str:
    """Upstream's generator source with :data:`TWEAKS` applied (each anchor exactly once)."""
    for old, new in TWEAKS:
        n = text.count(old)
        if n != 1:
            raise VendorError(f"{GENERATOR_SOURCE}: a dgr tweak's anchor occurs {n} times, "
                              f"expected once (the pinned tree changed?):\n{old}")
        text = text.replace(old, new)
    return text


def _vendor():
    from dgr.vendor import Vendor

    return Vendor()


def _workspace(vendor) -> Path:
    return vendor.cache / f"archs-{vendor.key()}"


#: the generator workspaces this process uses: each one's lock file, held shared until exit
_HELD: dict[Path, int] = {}
_LOCK = ".in-use"


def _hold(ws: Path) -> None:
    """Hold a shared lock on ``ws`` for the rest of this process, so that another process's
    :func:`_prune_other_keys` (another checkout's build, sharing ``$DGR_CACHE``) leaves its
    models alone while this one may still read them (it deleted a running suite's once)."""
    if ws in _HELD:
        return
    ws.mkdir(parents=True, exist_ok=True)
    fd = os.open(ws / _LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _HELD[ws] = fd


def _prune_other_keys(vendor) -> None:
    """Drop the generator workspaces of other vendor keys (about 1.7 GB of models each): they
    belong to another llama.cpp build and are rewritten in seconds when needed again. One that
    a live process holds (:func:`_hold`) is kept."""
    keep = _workspace(vendor).name
    for d in vendor.cache.glob("archs-*"):
        if not d.is_dir() or d.name == keep:
            continue
        try:
            fd = os.open(d / _LOCK, os.O_RDWR)
        except FileNotFoundError:
            fd = None  # written before locks, or by nobody alive
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    _say(f"keeping {d}: another process is using its models")
                    continue
            _say(f"removing {d} (models of another llama.cpp build)")
            shutil.rmtree(d, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)


def _common_libraries(vendor) -> list[Path]:
    b = vendor.build_dir / "common"
    return [b / "libllama-common.a", b / "libllama-common-base.a"]


def generator() -> Path:
    """The compiled generator for this vendor key; compiled on first use (progress on stderr).

    Raises
    ------
    dgr.errors.VendorError
        The vendor tree is not built, the source is missing or changed, or the compile fails
        (the compiler's output tail is in the message).
    """
    v = _vendor()
    src = v.src / GENERATOR_SOURCE
    if not v.is_built():
        raise VendorError(f"llama.cpp is not built at {v.workspace}: "
                          "run `python -m dgr.vendor build`")
    if not src.exists():
        raise VendorError(f"{src} is missing from the pinned tree")
    _hold(_workspace(v))
    text = tweaked_source(src.read_text())
    ws = _workspace(v)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    exe = ws / f"test-llama-archs-{digest}"
    if exe.exists():
        return exe
    if not all(p.exists() for p in _common_libraries(v)):
        # libllama-common is built by any vendor tool; llama-completion is the smallest one
        _say("building libllama-common (via the vendor's llama-completion target)")
        v.build(["llama-completion"])
        if not all(p.exists() for p in _common_libraries(v)):
            raise VendorError(f"building llama-completion left no {_common_libraries(v)}")
    ws.mkdir(parents=True, exist_ok=True)
    cpp = ws / f"test-llama-archs-{digest}.cpp"
    cpp.write_text(text)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    includes = [*v.include_dirs(), v.src / "common", v.src / "vendor", v.build_dir / "common"]
    tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
    cmd = [cxx, "-std=c++17", "-O1", str(cpp), "-o", str(tmp),
           *(f"-I{d}" for d in includes),
           *map(str, _common_libraries(v)), *map(str, v.libraries()), *v.link_args()]
    _say(f"compiling {GENERATOR_SOURCE} (llama.cpp {v.commit[:12]}) into {ws}")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        raise VendorError(f"compiling {GENERATOR_SOURCE} took over {e.timeout} s") from None
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise VendorError(f"compiling {GENERATOR_SOURCE} failed (exit {proc.returncode}):\n"
                          f"{' '.join(cmd)}\n{(proc.stderr or proc.stdout)[-3000:]}")
    tmp.replace(exe)
    _say(f"compiled in {time.monotonic() - t0:.0f} s: {exe}")
    return exe


@dataclass(frozen=True)
class Written:
    """What one generator run produced: the files, and the models it could not write."""

    files: tuple[Path, ...]
    #: ``(arch, "dense" | "moe", reason)`` for each model the generator threw on
    failed: tuple[tuple[str, str, str], ...]

    @property
    def archs(self) -> list[str]:
        """Architecture names with at least one file, in file order."""
        out: list[str] = []
        for f in self.files:
            a = arch_of(f)
            if a not in out:
                out.append(a)
        return out


def arch_of(path: Path) -> str:
    """The architecture a generator file is named after (``qwen3moe-moe.gguf`` -> ``qwen3moe``)."""
    return re.sub(r"-(dense|moe)\.gguf$", "", Path(path).name)


def write(arch_regex: str = "", out_dir: str | Path | None = None, *,
          timeout: float = 600, n_layer: int = N_LAYER) -> Written:
    """Write the generator's models for every architecture whose name matches ``arch_regex``
    (a ``std::regex`` search, as ``-a`` takes it; empty for all) into ``out_dir``, with
    ``n_layer`` layers where the generator takes its default count.

    Without ``out_dir`` the models go to the cache (``$DGR_CACHE/archs-<vendor key>/``, one
    directory per regex) and a finished run is reused. With ``out_dir`` the generator always
    runs. The run's progress is on stderr.

    Raises
    ------
    dgr.errors.VendorError
        The generator cannot be built, or its run fails or outlasts ``timeout`` seconds.
    """
    exe = generator()
    cached = out_dir is None
    if cached:
        _prune_other_keys(_vendor())
        key = f"{exe.name}\0{SEED}\0{arch_regex}" + (f"\0{n_layer}" if n_layer != N_LAYER else "")
        tag = hashlib.sha256(key.encode()).hexdigest()[:12]
        out = _workspace(_vendor()) / f"models-{tag}"
        stamp = out / "written.json"
        try:
            rec = json.loads(stamp.read_text())
            files = tuple(out / f for f in rec["files"])
            if all(f.exists() for f in files):
                return Written(files, tuple(tuple(x) for x in rec["failed"]))
        except (OSError, ValueError, KeyError):
            pass
    else:
        out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # write into a fresh directory beside the target, then move the files in
    tmp = Path(tempfile.mkdtemp(prefix=".archs-", dir=out))
    cmd = [str(exe), "-s", str(SEED), "-o", str(tmp)] + (["-a", arch_regex] if arch_regex else [])
    _say(f"writing models for {arch_regex or 'every architecture'!r} into {out}")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=timeout,
                              env={**os.environ, "DGR_ARCHS_N_LAYER": str(int(n_layer))})
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise VendorError(f"{' '.join(cmd)} ran over {timeout} s") from None
    pattern = rf"^{FAILED_TAG} (\S+) (dense|moe): (.*)$"
    failed = tuple((m.group(1), m.group(2), m.group(3).strip())
                   for m in re.finditer(pattern, proc.stderr, re.M))
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise VendorError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                          f"{proc.stderr[-3000:]}")
    files = []
    for f in sorted(tmp.glob("*.gguf")):
        dest = out / f.name
        f.replace(dest)
        files.append(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    _say(f"wrote {len(files)} models in {time.monotonic() - t0:.1f} s"
         + (f"; the generator failed on {len(failed)}: "
            + ", ".join(f"{a} ({k})" for a, k, _ in failed) if failed else ""))
    if cached:
        stamp.write_text(json.dumps({"files": [f.name for f in files],
                                     "failed": [list(x) for x in failed]}, indent=1))
    return Written(tuple(files), failed)


# -- probing: whole load, forward, and the split verdict ------------------------------

#: engine settings of every probe (small, single-threaded, so runs are deterministic)
#: the families people split across machines (DeepSeek V3/R1 and Kimi ``deepseek2``, Qwen3 MoE,
#: GLM-4.5, gpt-oss, Llama 4, dense Qwen2/2.5/3, Gemma 3, Mistral 3, Phi-3, Llama, DeepSeek V4,
#: DeepSeek V3.2, and the hybrid Qwen3.5 dense and MoE, Qwen3-Next and Nemotron-H): the suite
#: requires each to be written by the generator and to split bit-exact
FAMILIES = ("qwen2", "qwen3", "qwen3moe", "gemma3", "deepseek2", "glm4moe", "gpt-oss", "llama4",
            "phi3", "mistral3", "llama", "deepseek4", "deepseek32", "qwen35", "qwen35moe",
            "qwen3next", "nemotron_h", "kimi-k3", "glm-dsa", "rwkv7")
PROBE_SETTINGS = dict(n_ctx=256, n_threads=1, n_ubatch=8, flash_attn=True)
PROBE_PROMPT = 11  # tokens: one full ubatch of 8 and a ragged tail of 3
PROBE_DECODE = 3
_CHILD = "import sys; from dgr.testing.archs import _probe_main; _probe_main(sys.argv[1:])"


def _splits(n_layer: int) -> list[list[tuple[int, int]]]:
    """One cut at every interior boundary, then all single-layer stages (when 3+ layers)."""
    out = [[(0, k), (k, n_layer)] for k in range(1, n_layer)]
    if n_layer > 2:
        out.append([(i, i + 1) for i in range(n_layer)])
    return out


def probe(path: str | Path) -> dict:
    """Load ``path`` whole and run a forward; then try a split.

    Returns ``{"file", "arch", "n_layer", "whole", "forward_finite", "supported", "split",
    "split_ok"}``. ``whole`` is ``"ok"`` or ``"error: <Type>: <message>"``. For an
    architecture :func:`dgr._core.arch_supports_layer_range` refuses, ``split`` tells whether
    a ``(0, 1)`` stage raised :class:`~dgr.errors.UnsupportedArchitecture` naming the arch;
    for one it accepts, every split of :func:`_splits` is compared with the whole model
    (prompt rows and greedy decode, bit for bit).
    """
    path = Path(path)
    with tempfile.TemporaryFile("w+", errors="replace") as log, _fd2_into(log):
        return _probe(path, log)


@contextlib.contextmanager
def _fd2_into(log):
    """Send fd 2 (where llama.cpp logs) into ``log`` for the block, then copy it to stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        log.seek(0)
        sys.stderr.write(log.read())
        sys.stderr.flush()


def _probe(path: Path, log) -> dict:
    import numpy as np

    from dgr import errors
    from dgr._core import arch_supports_layer_range
    from dgr.control.parity import compare
    from dgr.core.engine import Engine

    def why(e: Exception) -> str:
        """The error, and llama.cpp's last load error when it logged one (DGR_LLAMA_LOG)."""
        out = f"{type(e).__name__}: {e}".replace(str(path), path.name)
        log.seek(0)
        found = re.findall(r"error loading model: (.*)", log.read())
        log.seek(0, os.SEEK_END)
        return out + (f" [llama.cpp: {found[-1].strip()}]" if found else "")

    rec: dict = {"file": path.name, "arch": arch_of(path), "n_layer": None, "whole": None,
                 "forward_finite": None, "supported": None, "split": None, "split_ok": False}
    try:
        whole = Engine(path, **PROBE_SETTINGS)
        rec["arch"], rec["n_layer"] = whole.arch, whole.n_layer
        n_vocab = whole.describe()["n_vocab"]
        prompt = (np.arange(PROBE_PROMPT, dtype=np.int32) * 7 + 3) % n_vocab
        lg = whole.forward(0, 0, prompt)
        rec["forward_finite"] = bool(np.isfinite(lg).all())
        rec["whole"] = "ok"
    except Exception as e:  # noqa: BLE001 - the verdict records any failure
        rec["whole"] = f"error: {why(e)}"
        return rec
    arch, n = rec["arch"], rec["n_layer"]
    rec["supported"] = bool(arch_supports_layer_range(arch))
    if not rec["supported"]:
        try:
            Engine(path, layers=(0, 1), **PROBE_SETTINGS)
            rec["split"] = "NOT refused: a (0, 1) stage loaded"
        except errors.UnsupportedArchitecture as e:
            named = arch in str(e)
            rec["split"] = "refused" if named else f"refused without naming {arch!r}: {e}"
            rec["split_ok"] = named
        except Exception as e:  # noqa: BLE001
            rec["split"] = f"wrong error: {why(e)}"
        return rec
    done = []
    try:
        for ranges in _splits(n):
            rep = compare(path, ranges, prompt, decode_steps=PROBE_DECODE, whole=whole,
                          **PROBE_SETTINGS)
            name = "-".join(f"{a}:{b}" for a, b in ranges)
            if not rep.bit_identical:
                bad = [(s.step, s.max_abs_diff) for s in rep.steps if not s.bit_identical]
                rec["split"] = (f"FAIL {name}: prompt rows identical {rep.prompt_rows_identical}, "
                                f"steps differ {bad}")
                return rec
            done.append(name)
    except Exception as e:  # noqa: BLE001
        rec["split"] = f"error after {len(done)} splits: {why(e)}"
        return rec
    rec["split"] = f"pass {len(done)} splits bit-exact"
    rec["split_ok"] = True
    return rec


def _probe_main(files: list[str]) -> None:
    """Child side of :func:`probe_all`: a ``start`` line before, a result line after, each file."""
    for f in files:
        print(json.dumps({"start": f}), flush=True)
        print(json.dumps({"result": probe(f)}), flush=True)


def _pump(stream, lines: queue.Queue) -> None:
    """Copy a child's stdout lines into ``lines``, then ``None`` at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def probe_all(files, *, per_file_timeout: float = 120,
              log_dir: str | Path | None = None) -> list[dict]:
    """:func:`probe` every file in child processes, so an abort in llama.cpp costs one file.

    A child runs the files in order; when it dies (an abort, a signal) or a file outlasts
    ``per_file_timeout`` seconds, that file is recorded as ``whole: "crash: ..."`` /
    ``"timeout ..."`` (with the last lines of the child's stderr) and a fresh child takes the
    rest. Children's stderr (llama.cpp's warnings and errors, ``DGR_LLAMA_LOG=1``, unless
    set otherwise) goes to ``log_dir`` (a temporary directory by default).
    """
    files = [str(f) for f in files]
    results: dict[str, dict] = {}
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="dgr-archs-probe-"))
    logs.mkdir(parents=True, exist_ok=True)
    todo = list(files)
    run = 0
    while todo:
        run += 1
        log = logs / f"probe-{run}.stderr"
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, *todo],
                stdout=subprocess.PIPE, stderr=err, text=True,
                env={"DGR_LLAMA_LOG": "1", **os.environ})  # llama.cpp's warnings and errors
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
        reader.start()
        current = None
        why = None
        while True:
            try:
                line = lines.get(timeout=per_file_timeout)
            except queue.Empty:
                why = f"timeout: no result in {per_file_timeout} s"
                proc.kill()
                break
            if line is None:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not ours: something else wrote to the child's stdout
            if not isinstance(msg, dict):
                continue
            if "start" in msg:
                current = msg["start"]
            else:
                results[current] = msg["result"]
                todo.remove(current)
                current = None
        rc = proc.wait(timeout=60)
        reader.join(timeout=60)
        proc.stdout.close()
        if current is None:
            if todo:  # died between files: do not loop forever
                current = todo[0]
            else:
                break
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-3:]
        why = why or f"crash: exit {rc}"
        results[current] = {"file": Path(current).name, "arch": arch_of(Path(current)),
                            "n_layer": None, "whole": f"{why}: {' | '.join(tail)[-400:]}",
                            "forward_finite": None, "supported": None, "split": None,
                            "split_ok": False}
        todo.remove(current)
    return [results[f] for f in files]


def format_table(rows: list[dict]) -> str:
    """A plain-text table: file / arch / layers / whole load / split result."""
    head = ("file", "arch", "layers", "whole load", "split")
    body = [(r["file"], r["arch"], "?" if r["n_layer"] is None else str(r["n_layer"]),
             r["whole"] + ("" if r["forward_finite"] in (None, True) else " (non-finite logits)"),
             r["split"] or "-") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(4)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*x) for x in [head, *body])


def format_markdown(rows: list[dict], failed: Sequence[tuple[str, str, str]] = ()) -> str:
    """The support table of docs/architectures.md: one row per architecture (its dense and
    MoE files together), whole load and split verdict, with the date and the pinned commit."""
    from dgr.core.refusals import refusal_reason

    v = _vendor()
    by_arch: dict[str, list[dict]] = {}
    for r in rows:
        by_arch.setdefault(r["arch"], []).append(r)
    lines = [
        "# Architectures",
        "",
        "Every architecture the pinned llama.cpp's own fixture generator "
        "(`test-llama-archs.cpp` of its tests, grown to 4 layers by `dgr.testing.archs`) writes, "
        "loaded by dgr whole and split. Written by `python -m dgr.testing.archs --markdown "
        "docs/architectures.md` from a probe of every file, each in a child process; "
        "`tests/integration/test_archs.py` makes the same checks in the suite and "
        "`tests/unit/test_architectures_doc.py` that this table is current.",
        "",
        f"- date: {time.strftime('%Y-%m-%d', time.gmtime())}",
        f"- llama.cpp commit: `{v.commit}`, patch stack `{v.patch_stack_hash()[:16]}`",
        f"- {len(by_arch)} architectures, {len(rows)} files; "
        f"{sum(1 for rs in by_arch.values() if all(r['split_ok'] and r['supported'] for r in rs))}"
        " split bit-exact at every interior boundary and in single-layer stages",
        "",
        "**split**: `pass N` (N splits compared bit for bit with the whole model); `refused` "
        "(a partial range raises `UnsupportedArchitecture` naming the architecture and the "
        "reason given here, `dgr.core.refusals`); `FAIL` (see the reason).",
        "",
        "**Recurrent and hybrid models** (Mamba, Jamba, Falcon-H1, Granite-Hybrid, Nemotron-H, "
        "LFM2, PLaMo-2, Qwen3-Next, Qwen3.5, Kimi Linear, MiniMax-01, RWKV-6/7, ARWKV-7): each stage keeps the "
        "conv/SSM (delta-net, short-conv) state and the attention KV of its own layers only, "
        "one state cell per session, and the state never crosses a seam (patches 0014, 0016, 0025). "
        "Batched sessions each have their own cells; a failover re-prefills, as for any model; "
        "`n` > 1 forks a session's state cell on every stage. A state keeps no history of its "
        "positions: each stage keeps state snapshots at the ends of a session's last whole "
        "`n_ubatch` chunks prefilled from position 0, and a prompt cache's next turn restores "
        "one (docs/serve.md \"Prompt cache\"); such a stage keeps no prefix-store entries and "
        "drafts nothing: a route asked to speculate on it is refused by name (its "
        "`rollback_window` is 0). `tests/integration/test_hybrid_splits.py` and "
        "`tests/system/test_hybrid_workers.py` check them at 8 layers in 3 stages. The diffusion "
        "models (dream, llada, llada-moe, rnd1) stay refused: a denoising step is a non-causal "
        "forward over the whole sequence with no cache to keep per stage.",
        "",
        "**Sidebands** (docs/wire.md \"Sidebands\"): talkie, cogvlm and qwen4exp stages take the "
        "token ids with the boundary (qwen4exp gathers its per-layer embeddings from them), "
        "Kimi-K3's seams carry its banked residual checkpoints, hy_v4's, glm5-next's and "
        "qwen4exp's their hyper-connection streams, and glm-dsa's, hy_v4's and glm5-next's the "
        "last full-indexer layer's selection in a wider row, HRM-Text's its cycle state (its "
        "layers are the cache slots of unrolled passes), RWKV-7's and ARWKV-7's the first "
        "layer's value `v_first`; qwen3vl's deepstack part of a token "
        "row is zeros a later stage adds too (patches 0018-0025; "
        "`tests/integration/test_sideband_splits.py` checks them at more layers: Kimi-K3 at 26, "
        "the shared-indexer models with shared layers, HRM-Text with seams inside a pass).",
        "",
        "| architecture | files | layers | whole load + forward | split |",
        "|---|---|---|---|---|",
    ]
    for arch in sorted(by_arch):
        rs = by_arch[arch]
        files = ", ".join(r["file"].removesuffix(".gguf").removeprefix(arch + "-") for r in rs)
        layers = ", ".join(sorted({"?" if r["n_layer"] is None else str(r["n_layer"])
                                   for r in rs}))
        whole = "ok" if all(r["whole"] == "ok" for r in rs) else "; ".join(
            f"{r['file']}: {r['whole']}" for r in rs if r["whole"] != "ok")
        if all(r["split_ok"] and r["supported"] for r in rs):
            split = "pass " + ", ".join(r["split"].split()[1] for r in rs)
        elif all(r["split_ok"] for r in rs):
            split = f"refused ({refusal_reason(arch)})"
        else:
            split = "FAIL: " + "; ".join(f"{r['file']}: {r['split']}" for r in rs
                                         if not r["split_ok"])
        lines.append(f"| `{arch}` | {files} | {layers} | {whole} | {split} |")
    for arch, kind, why in failed:
        lines.append(f"| `{arch}` | {kind} | - | not written: {why} | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m dgr.testing.archs",
        description="Write every architecture's fixture (cached), probe each in a child "
                    "process (whole load, forward, split parity or refusal) and print the table.")
    ap.add_argument("--arch", default="", help="architecture regex (default: all)")
    ap.add_argument("--markdown", help="also write the support table (docs/architectures.md)")
    args = ap.parse_args(argv)
    written = write(args.arch)
    rows = probe_all(written.files)
    print(format_table(rows))
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(rows, written.failed))
        _say(f"wrote {args.markdown}")
    return 0 if all(r["whole"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
