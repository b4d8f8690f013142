"""trtexec: find it, build its command lines for TensorRT 8.6/10/11, run it, parse its output.

Precision flags depend on the TensorRT version: ``--fp16 --int8`` exist only up to TensorRT 10
(weakly typed builds); TensorRT 11 builds strongly typed networks only, with precisions taken from the
ONNX (Q/DQ nodes, ``--half``), and its ``--stronglyTyped``, ``--useCudaGraph``, ``--useSpinWait``,
``--noDataTransfers`` and ``--separateProfileRun`` are deprecated no-ops (their behaviour is the default),
so they are not passed there. Plugin libraries go to ``--staticPlugins`` (``--plugins`` is deprecated).
Sources for every flag: docs/TENSORRT.md, "TensorRT API, flags and plugins used".

:func:`build_engine` is what ``scripts/generate_trt_engine.sh`` runs (through ``scripts/trtexec_cli.py build``),
so the flags live here only; :func:`parse_trtexec_output` turns a saved trtexec log into a dict.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

from utils.qat.core.atomic import write_text
from utils.qat.core.errors import QATError
from utils.qat.trt.trt_common import (INSTALL_TENSORRT, check_plugin_files, installed_version, profile_shapes,
                                  read_image_input, require_onnx, version_tuple)

PathLike = Union[str, "os.PathLike[str]"]
SEARCH_DIRS: tuple[str, ...] = ("/usr/src/tensorrt/bin", "/opt/tensorrt/bin")
#: Benchmark flags for TensorRT <= 10; on 11 they are deprecated no-ops (CUDA graphs, spin wait and no data
#: transfers are the defaults: samples/common/sampleOptions.cpp of v11.0 and v11.1).
BENCH_FLAGS = ("--useCudaGraph", "--useSpinWait", "--noDataTransfers")


# ----------------------------------------------------------------------------- locating trtexec
def find_trtexec(search_dirs: Sequence[str] = SEARCH_DIRS) -> Path:
    """``$TRTEXEC``, else ``trtexec`` on PATH, else the usual TensorRT install folders."""
    override = os.environ.get("TRTEXEC")
    if override:
        p = Path(override)
        if p.is_file() and os.access(p, os.X_OK):
            return p
        raise QATError(f"TRTEXEC={override} is not an executable file; point it at trtexec or unset it.")
    found = shutil.which("trtexec")
    if found:
        return Path(found)
    for d in search_dirs:
        p = Path(d) / "trtexec"
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise QATError(f"trtexec was not found on PATH nor in {' or '.join(search_dirs)}: it ships with the TensorRT "
                   f"tarball, its Debian/RPM packages and the NGC containers (not with the pip wheels that "
                   f"{INSTALL_TENSORRT} installs), so put it on PATH or set TRTEXEC=/path/to/trtexec, or build with "
                   f"the Python API instead (python3 scripts/build_engine.py ONNX ENGINE --imgsz N).")


def decode_version_tag(tag: int) -> str:
    """trtexec's ``[TensorRT vNNNN]`` number as ``major.minor.patch`` (8601 -> 8.6.1, 100300 -> 10.3.0)."""
    if tag >= 100000:  # TensorRT 10+: major * 10000 + minor * 100 + patch
        return f"{tag // 10000}.{tag // 100 % 100}.{tag % 100}"
    return f"{tag // 1000}.{tag // 100 % 10}.{tag % 100}"  # TensorRT <= 9: major * 1000 + minor * 100 + patch


_VERSION_TAG = re.compile(r"\[TensorRT v(\d+)\]")
_VERSION_LINE = re.compile(r"TensorRT version:\s*(\d+\.\d+(?:\.\d+)*)")


def parse_version_text(text: str) -> str | None:
    """The TensorRT version trtexec reports (``TensorRT version: X.Y.Z`` or ``[TensorRT vNNNNNN]``)."""
    m = _VERSION_LINE.search(text)
    if m:
        return m.group(1)
    t = _VERSION_TAG.search(text)
    return decode_version_tag(int(t.group(1))) if t else None


def trtexec_version(trtexec: PathLike) -> str | None:
    """Ask trtexec for its TensorRT version (its ``--help`` banner carries ``[TensorRT vNNNNNN]``)."""
    try:
        r = subprocess.run([str(trtexec), "--help"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_version_text(r.stdout + r.stderr)


# ----------------------------------------------------------------------------- command lines
def shape_arg(name: str, shape: Sequence[int]) -> str:
    return f"{name}:{'x'.join(str(int(s)) for s in shape)}"


def precision_flags(version: str | Sequence[int], *, int8: bool = True, fp16: bool = True,
                    strongly_typed: bool = False) -> list[str]:
    """``--fp16``/``--int8`` on TensorRT <= 10 (weakly typed), ``--stronglyTyped`` when asked on 10, nothing on
    11 (strongly typed is the only mode there; its ``--stronglyTyped`` is a deprecated no-op)."""
    major, _minor = version_tuple(version)
    if major >= 11:
        return []  # precisions come from the ONNX (Q/DQ, --half export)
    if strongly_typed:
        if major < 10:
            raise QATError(f"trtexec of TensorRT {major}.x has no --stronglyTyped; build weakly typed (drop "
                           f"--strongly-typed), or strongly typed with TensorRT 10+ through its Python API "
                           f"(python3 scripts/build_engine.py ONNX ENGINE, after {INSTALL_TENSORRT}: the pip wheels "
                           f"bring no trtexec).")
        return ["--stronglyTyped"]
    return (["--fp16"] if fp16 else []) + (["--int8"] if int8 else [])


def build_command(onnx: PathLike, engine: PathLike, *, version: str | Sequence[int], int8: bool = True,
                  fp16: bool = True, strongly_typed: bool = False, input_name: str = "images",
                  min_shape: Sequence[int] | None = None, opt_shape: Sequence[int] | None = None,
                  max_shape: Sequence[int] | None = None, timing_cache: PathLike | None = None,
                  workspace_mib: int | None = None, graph_prefix: PathLike | None = None,
                  skip_inference: bool = True, plugins: Sequence[PathLike] = (), extra: Iterable[str] = (),
                  trtexec: PathLike = "trtexec") -> list[str]:
    """trtexec command that builds ``engine`` from ``onnx``.

    ``min/opt/max_shape`` (B, C, H, W) give the optimization profile of a dynamic input; leave them out for
    a static ONNX (trtexec refuses shapes there: "Static model does not take explicit shapes").
    ``graph_prefix`` adds ``--exportLayerInfo=P.layer.json --exportProfile=P.profile.json
    --profilingVerbosity=detailed`` (and, before TensorRT 11, a separate profiling run so the timing is not
    skewed; 11 always separates them). ``plugins``: plugin libraries (``--staticPlugins``).
    """
    major, _minor = version_tuple(version)
    cmd = [str(trtexec), f"--onnx={onnx}", f"--saveEngine={engine}"]
    cmd += precision_flags(version, int8=int8, fp16=fp16, strongly_typed=strongly_typed)
    cmd += plugin_flags(plugins)
    shapes = (min_shape, opt_shape, max_shape)
    if any(s is not None for s in shapes):
        if not all(s is not None for s in shapes):
            raise QATError("give all three of min/opt/max shapes (or none, for a static ONNX).")
        for flag, s in zip(("--minShapes", "--optShapes", "--maxShapes"), shapes):
            assert s is not None
            cmd.append(f"{flag}={shape_arg(input_name, s)}")
    if workspace_mib is not None:
        cmd.append(f"--memPoolSize=workspace:{int(workspace_mib)}")  # MiB is trtexec's default unit
    if timing_cache is not None:
        cmd.append(f"--timingCacheFile={timing_cache}")
    if graph_prefix is not None:
        cmd += [f"--exportLayerInfo={graph_prefix}.layer.json", f"--exportProfile={graph_prefix}.profile.json",
                "--profilingVerbosity=detailed"] + (["--separateProfileRun"] if major < 11 else [])
    elif skip_inference:
        cmd.append("--skipInference")
    cmd += list(extra)
    return cmd


def plugin_flags(plugins: Sequence[PathLike]) -> list[str]:
    """``--staticPlugins=LIB`` per plugin library (trtexec 10.x and 11.x; ``--plugins`` is deprecated)."""
    return [f"--staticPlugins={p}" for p in plugins]


def benchmark_command(source: PathLike, *, batch: int, version: str | Sequence[int],
                      shape: Sequence[int] | None = (3, 640, 640), input_name: str = "images", int8: bool = True,
                      fp16: bool = True, strongly_typed: bool = False, warmup: int = 500, duration: int = 10,
                      timing_cache: PathLike | None = None, plugins: Sequence[PathLike] = (),
                      extra: Iterable[str] = (), trtexec: PathLike = "trtexec") -> list[str]:
    """trtexec command that times ``source`` at ``batch``: an engine (``--loadEngine``, ``--shapes``) or an
    ONNX (built for min 1 / opt and max ``batch``, as the reference README does) with ``--warmUp --duration``
    (plus ``--useCudaGraph --useSpinWait --noDataTransfers`` before TensorRT 11, where they became the
    defaults). ``shape`` is C, H, W; None for a static-shape ONNX or engine (no shape flags)."""
    src = Path(source)
    major, _minor = version_tuple(version)
    full = (batch, *shape) if shape is not None else None
    if src.suffix.lower() == ".onnx":
        if full is None:
            cmd = [str(trtexec), f"--onnx={src}"]
        else:
            cmd = [str(trtexec), f"--onnx={src}", f"--minShapes={shape_arg(input_name, (1, *full[1:]))}",
                   f"--optShapes={shape_arg(input_name, full)}", f"--maxShapes={shape_arg(input_name, full)}"]
        cmd += precision_flags(version, int8=int8, fp16=fp16, strongly_typed=strongly_typed)
        if timing_cache is not None:
            cmd.append(f"--timingCacheFile={timing_cache}")
    else:
        cmd = [str(trtexec), f"--loadEngine={src}"]
        if full is not None:
            cmd.append(f"--shapes={shape_arg(input_name, full)}")
    cmd += plugin_flags(plugins)
    cmd += [f"--warmUp={int(warmup)}", f"--duration={int(duration)}", *(BENCH_FLAGS if major < 11 else ()), *extra]
    return cmd


def run_trtexec(cmd: Sequence[str], log_path: PathLike | None = None, echo: bool = True) -> tuple[int, str]:
    """Run trtexec, streaming its output (when ``echo``); the full output is saved to ``log_path``."""
    try:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
    except OSError as e:
        raise QATError(f"could not start {cmd[0]} ({e}); check the TensorRT install ({INSTALL_TENSORRT}).") from e
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()
    rc = proc.wait()
    text = "".join(lines)
    if log_path is not None:
        write_text(log_path, text)
    return rc, text


# ----------------------------------------------------------------------------- output parsing
_PREFIX = re.compile(r"^(?:\[[^\]]*\]\s*)+")
_UNIT_MS = {"ms": 1.0, "us": 1e-3, "µs": 1e-3, "ns": 1e-6, "s": 1e3}
_UNIT_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan"
_STAT = re.compile(rf"^\s*(min|max|mean|median|percentile\((?P<pct>[\d.]+)%\))\s*=\s*(?P<val>{_NUM})\s*(?P<unit>ms|us|µs|ns|s)?\s*$",
                   re.IGNORECASE)
_SHAPES = re.compile(r"--(?:shapes|optShapes)=([^\s]+)")


def _strip(line: str) -> str:
    return _PREFIX.sub("", line.rstrip("\r\n")).strip()


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _stats(rest: str) -> dict[str, float] | None:
    out: dict[str, float] = {}
    for part in rest.split(","):
        m = _STAT.match(part)
        if not m:
            return None
        val = float(m.group("val")) * _UNIT_MS[(m.group("unit") or "ms").lower()]
        label = m.group(1).lower()
        out[f"p{m.group('pct')}" if m.group("pct") else label] = val
    return out or None


def _seconds(value: str) -> float | None:
    m = re.match(rf"\s*({_NUM})\s*(ms|us|µs|ns|s)?\s*$", value)
    return float(m.group(1)) * _UNIT_S[(m.group(2) or "s").lower()] if m else None


def parse_trtexec_output(text: str) -> dict[str, Any]:
    """Parse a trtexec log (TensorRT 8.6, 10, 11). Returns::

        {"tensorrt_version": "10.3.0", "status": "PASSED", "command": "...", "batch": 4,
         "device": {"name": ..., "compute_capability": ..., ...},
         "throughput_qps": 472.7,
         "latency": {"min", "max", "mean", "median", "p90", "p95", "p99"},     # ms
         "enqueue_time": {...}, "h2d_latency": {...}, "gpu_compute_time": {...}, "d2h_latency": {...},
         "total_host_walltime_s": 10.0, "total_gpu_compute_time_s": 9.99, "warnings": [...]}

    Log-line prefixes (``[08/20/2024-10:12:31] [I]``) and CRLF endings are ignored; when a log holds
    several performance summaries the last one counts. Raises QATError when there is none.
    """
    lines = [_strip(line) for line in text.splitlines()]
    res: dict[str, Any] = {"tensorrt_version": parse_version_text(text), "status": None, "command": None,
                           "batch": None, "device": {}}
    for raw in text.splitlines():
        m = re.search(r"&&&& (RUNNING|PASSED|FAILED|WAIVED)\b.*?#\s*(.*)$", raw)
        if m:
            if m.group(1) == "RUNNING":
                res["command"] = m.group(2).strip()
            else:
                res["status"] = m.group(1)
    if res["command"]:
        sm = _SHAPES.search(res["command"])
        if sm:
            dims = re.search(r":(\d+)x", sm.group(1))
            res["batch"] = int(dims.group(1)) if dims else None
    dev_keys = {"selected device": "name", "compute capability": "compute_capability", "sms": "sms",
                "device global memory": "global_memory", "application compute clock rate": "compute_clock",
                "application memory clock rate": "memory_clock"}
    starts = [i for i, line in enumerate(lines) if line.startswith("=== Performance summary ===")]
    for i, line in enumerate(lines):
        if line.startswith("=== Device Information ==="):
            for dl in lines[i + 1:]:
                if dl.startswith("==="):
                    break
                k, sep, v = dl.partition(":")
                if sep and k.strip().lower() in dev_keys:
                    res["device"][dev_keys[k.strip().lower()]] = v.strip()
    if not starts:
        errors = [ln for raw, ln in zip(text.splitlines(), lines) if "[E]" in raw][:1]
        hint = f" (first error: {errors[0]})" if errors else ""
        raise QATError(f"no '=== Performance summary ===' in the trtexec output{hint}: the run failed or was cut "
                       f"short (or used --skipInference); see its log.")
    warnings: list[str] = []
    for line in lines[starts[-1] + 1:]:
        if line.startswith("==="):
            break
        if line.startswith("*"):
            warnings.append(line.lstrip("* ").strip())
            continue
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        key = _key(name)
        if key == "throughput":
            m = re.match(rf"\s*({_NUM})\s*qps", rest)
            if m:
                res["throughput_qps"] = float(m.group(1))
        elif key in ("total_host_walltime", "total_gpu_compute_time"):
            sec = _seconds(rest)
            if sec is not None:
                res[f"{key}_s"] = sec
        else:
            stats = _stats(rest)
            if stats is not None:
                res[key] = stats
    res["warnings"] = warnings
    if "throughput_qps" not in res or "latency" not in res:
        raise QATError("the trtexec performance summary has no Throughput/Latency lines; the log is truncated or "
                       "of an unknown format: rerun the benchmark.")
    return res


# ----------------------------------------------------------------------------- building an engine
def build_engine(onnx: PathLike, engine: PathLike, *, min_batch: int = 1, opt_batch: int | None = None,
                 max_batch: int = 16, imgsz: int | None = None, fp16_only: bool = False, strongly_typed: bool = False,
                 graph: bool = False, timing_cache: PathLike | None = None, workspace_mib: int | None = None,
                 plugins: Sequence[PathLike] = (), trt_version: str | None = None, extra: Sequence[str] = (),
                 dry_run: bool = False, echo: bool = True) -> list[str]:
    """Build ``engine`` from ``onnx`` with trtexec, flags chosen for its TensorRT version; return the command.

    The engine is written atomically (trtexec writes a hidden ``.X.engine.PID.part`` that is renamed into
    place), with ``X.engine.json`` (:func:`utils.qat.trt.trt_engine.write_engine_metadata`) and trtexec's log
    ``X.engine.build.log``; ``graph`` adds ``X.engine.layer.json`` and ``X.engine.profile.json``. ``trt_version``:
    the TensorRT version of trtexec (default: asked from it). ``dry_run``: only work out the command (no trtexec
    needed when ``trt_version`` is given). ``echo``: stream trtexec's output (it is logged anyway).
    """
    onnx, engine = Path(onnx), Path(engine)
    require_onnx(onnx)
    if engine.suffix == ".onnx" or engine.resolve() == onnx.resolve():
        raise QATError(f"the engine path {engine} would overwrite the ONNX; name it X.engine.")
    trtexec = Path("trtexec") if dry_run and trt_version else find_trtexec()
    version = trt_version or trtexec_version(trtexec) or installed_version()
    if version is None:
        raise QATError(f"cannot tell which TensorRT {trtexec} belongs to; pass --trt-version MAJOR.MINOR.")
    name, dims = read_image_input(onnx)
    opt = opt_batch if opt_batch is not None else max_batch
    shapes = profile_shapes(dims, min_batch=min_batch, opt_batch=opt, max_batch=max_batch, imgsz=imgsz, name=name)
    major, minor = version_tuple(version)
    check_plugins(onnx, plugins, (major, minor))
    if major >= 11 and fp16_only:
        print("note: TensorRT 11 builds strongly typed: an FP16 baseline needs an ONNX exported with --half "
              "(precisions come from the ONNX); --fp16-only changes no flag here.", file=sys.stderr)
    tmp = engine.with_name(f".{engine.name}.{os.getpid()}.part")
    cmd = build_command(onnx, engine if dry_run else tmp, version=version, int8=not fp16_only, fp16=True,
                        strongly_typed=strongly_typed, input_name=name,
                        min_shape=shapes[0] if shapes else None, opt_shape=shapes[1] if shapes else None,
                        max_shape=shapes[2] if shapes else None,
                        timing_cache=timing_cache or f"{engine}.timing.cache", workspace_mib=workspace_mib,
                        graph_prefix=engine if graph else None, plugins=plugins, extra=extra, trtexec=trtexec)
    if dry_run:
        return cmd
    engine.parent.mkdir(parents=True, exist_ok=True)
    log = Path(f"{engine}.build.log")
    print(f"building {engine} with TensorRT {version}: {shlex.join(cmd)}", file=sys.stderr)
    try:
        rc, text = run_trtexec(cmd, log_path=log, echo=echo)
        if rc != 0 or not tmp.is_file():
            errs = [_strip(line) for line in text.splitlines() if "[E]" in line or "Error" in line][:1]
            why = f": {errs[0]}" if errs else ""
            raise QATError(f"trtexec failed (exit {rc}) building {engine}{why}; the full log is {log}.")
        os.replace(tmp, engine)
    finally:
        tmp.unlink(missing_ok=True)
    from utils.qat.trt.trt_engine import write_engine_metadata
    built = parse_version_text(text) or version
    h, w = (shapes[0][2], shapes[0][3]) if shapes else (dims[2], dims[3])
    batch = {"min": shapes[0][0], "opt": shapes[1][0], "max": shapes[2][0]} if shapes else \
        ({"min": dims[0], "opt": dims[0], "max": dims[0]} if dims[0] else None)
    flags = precision_flags(version, int8=not fp16_only, fp16=True, strongly_typed=strongly_typed)
    write_engine_metadata(engine, onnx, tensorrt_version=built, builder="trtexec", imgsz=[h, w] if h and w else None,
                          batch=batch, strongly_typed=major >= 11 or bool(strongly_typed),
                          precision_flags=[f[2:].upper() for f in flags if f in ("--fp16", "--int8")])
    return cmd


def check_plugins(onnx: Path, plugins: Sequence[PathLike], version: tuple[int, int]) -> None:
    """Before a (long) build: the plugin libraries exist, and a graph needing a plugin TensorRT does not ship
    (EfficientNMSX_TRT) has one; trtexec registers TensorRT's own plugins itself."""
    from utils.qat.trt.trt_engine import THIRD_PARTY_PLUGINS, onnx_metadata, plugin_hint
    check_plugin_files(plugins)
    needed = [p["name"] for p in onnx_metadata(onnx)["plugins"]]
    third = [n for n in needed if n in THIRD_PARTY_PLUGINS]
    if third and not plugins:
        raise QATError(f"{onnx} needs the plugin {third[0]}: {plugin_hint(third[0])} with --plugins PATH.so "
                       f"(or export with --nms onnx, which needs no plugin).")
    if version >= (10, 12) and "EfficientNMS_TRT" in needed:
        print("note: EfficientNMS_TRT is deprecated since TensorRT 10.12; export with --nms onnx for TensorRT's "
              "native NMS layer.", file=sys.stderr)
