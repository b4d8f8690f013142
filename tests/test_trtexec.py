"""trtexec command building and output parsing, the benchmark report, and the TensorRT shell scripts.

trtexec itself cannot run here (TensorRT cannot be installed in this workplace). The parser is tested
on trtexec logs of TensorRT 8.6, 10 and 11 under tests/data/trtexec/, WRITTEN FROM THE DOCUMENTED
OUTPUT FORMAT (TensorRT's samples/common/sampleReporting.cpp and trtexec docs), not captured; the
report, plot and scripts run for real, and the scripts are checked to fail clearly without TensorRT.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 -m pytest` from the repository root has it already
    sys.path.append(str(REPO))

from utils.qat.trt import bench_report, trt_common, trtexec  # noqa: E402
from utils.qat.core.errors import QATError  # noqa: E402

DATA = REPO / "tests" / "data" / "trtexec"
NO_TRTEXEC = shutil.which("trtexec") is None and not any(
    (Path(d) / "trtexec").exists() for d in trtexec.SEARCH_DIRS)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRTEXEC"}
    env.update(extra)
    return env


# ============================================================================= parsing
@pytest.mark.parametrize("name, version, batch, qps, p99, device, warning", [
    ("trt8.6_int8_b4.log", "8.6.1", 4, 450.034, 2.2376, "NVIDIA GeForce RTX 4090", "GPU compute time is unstable"),
    ("trt10_int8_b1.log", "10.3.0", 1, 1227.13, 0.820382, "NVIDIA H100 80GB HBM3", None),
    ("trt11_int8_b8.log", "11.1.0", 8, 319.566, 3.15006, "NVIDIA L40S", "Throughput may be bound by Enqueue Time"),
])
def test_parse_fixtures_of_each_version(name, version, batch, qps, p99, device, warning):
    r = trtexec.parse_trtexec_output((DATA / name).read_text())
    assert r["tensorrt_version"] == version and r["status"] == "PASSED" and r["batch"] == batch
    assert r["throughput_qps"] == pytest.approx(qps)
    assert r["latency"]["p99"] == pytest.approx(p99)
    assert set(r["latency"]) == {"min", "max", "mean", "median", "p90", "p95", "p99"}
    for key in ("enqueue_time", "h2d_latency", "gpu_compute_time", "d2h_latency"):
        assert set(r[key]) == {"min", "max", "mean", "median", "p90", "p95", "p99"}
    assert r["h2d_latency"]["max"] == 0.0  # --noDataTransfers
    assert r["gpu_compute_time"]["mean"] == pytest.approx(r["latency"]["mean"])
    assert 10.0 < r["total_host_walltime_s"] < 10.1 and 9.9 < r["total_gpu_compute_time_s"] < 10.1
    assert r["device"]["name"] == device and r["device"]["compute_capability"]
    assert (warning is None and r["warnings"] == []) or any(warning in w for w in r["warnings"])
    assert "--warmUp=500" in r["command"]


def test_parse_is_robust_to_line_endings_prefixes_units_and_repeats():
    text = (DATA / "trt10_int8_b1.log").read_text()
    base = trtexec.parse_trtexec_output(text)
    crlf = trtexec.parse_trtexec_output(text.replace("\n", "\r\n"))
    assert crlf["latency"] == base["latency"] and crlf["throughput_qps"] == base["throughput_qps"]
    # the reference README pastes the summary without the "[date] [I] " prefixes
    bare = "\n".join(line.split("] ", 2)[-1] if line.startswith("[") else line for line in text.splitlines())
    assert trtexec.parse_trtexec_output(bare)["latency"] == base["latency"]
    # microseconds and scientific notation; several summaries (e.g. two runs in one log): the last counts
    extra = ("[I] === Performance summary ===\n[I] Throughput: 2.5e3 qps\n"
             "[I] Latency: min = 390 us, max = 0.5 ms, mean = 4.1e-1 ms, median = 0.4 ms, percentile(99%) = 450 us\n"
             "[I] Total Host Walltime: 9500 ms\n")
    r = trtexec.parse_trtexec_output(text + extra)
    assert r["throughput_qps"] == 2500.0 and r["total_host_walltime_s"] == pytest.approx(9.5)
    assert r["latency"] == pytest.approx({"min": 0.39, "max": 0.5, "mean": 0.41, "median": 0.4, "p99": 0.45})
    # a custom --percentile=99.9 list
    r = trtexec.parse_trtexec_output("=== Performance summary ===\nThroughput: 10 qps\n"
                                     "Latency: min = 1 ms, max = 2 ms, mean = 1.5 ms, median = 1.5 ms, "
                                     "percentile(99.9%) = 1.99 ms\n")
    assert r["latency"]["p99.9"] == 1.99


def test_parse_failed_run_says_why():
    with pytest.raises(QATError, match=r"no '=== Performance summary ===' .*ModelImporter"):
        trtexec.parse_trtexec_output((DATA / "trt10_failed.log").read_text())
    assert trtexec.parse_version_text((DATA / "trt10_failed.log").read_text()) == "10.3.0"
    with pytest.raises(QATError, match="no Throughput/Latency"):
        trtexec.parse_trtexec_output("[I] === Performance summary ===\n[I] Throughput: 12 qps\n")


@pytest.mark.parametrize("tag, version", [(8601, "8.6.1"), (8503, "8.5.3"), (100300, "10.3.0"),
                                          (101300, "10.13.0"), (110000, "11.0.0"), (110401, "11.4.1")])
def test_version_tags(tag, version):
    assert trtexec.decode_version_tag(tag) == version
    assert trtexec.parse_version_text(f"&&&& RUNNING TensorRT.trtexec [TensorRT v{tag}] # trtexec") == version
    # TensorRT 11 adds the build number after the version (samples/common/logging.h of v11.1)
    assert trtexec.parse_version_text(f"&&&& RUNNING TensorRT.trtexec [TensorRT v{tag}] [b106] # trtexec") == version


def test_fixture_banners_match_nvidias_logging_sources():
    """logging.h defineTest(): no build tag up to 10.x, '[bNNN]' from 11 on (see tests/data/trtexec/README.md)."""
    for name, banner in (("trt8.6_int8_b4.log", "[TensorRT v8601] #"), ("trt10_int8_b1.log", "[TensorRT v100300] #"),
                         ("trt11_int8_b8.log", "[TensorRT v110100] [b106] #")):
        runs = [line for line in (DATA / name).read_text().splitlines() if line.startswith("&&&&")]
        assert runs and all(banner in line for line in runs), name
    assert "--useCudaGraph" not in (DATA / "trt11_int8_b8.log").read_text()


# ============================================================================= commands
def test_build_command_per_version():
    shapes = {"min_shape": (1, 3, 640, 640), "opt_shape": (8, 3, 640, 640), "max_shape": (8, 3, 640, 640)}
    c10 = trtexec.build_command("m.onnx", "m.engine", version="10.3", timing_cache="m.cache", **shapes)
    assert c10[:3] == ["trtexec", "--onnx=m.onnx", "--saveEngine=m.engine"]
    assert "--fp16" in c10 and "--int8" in c10 and "--stronglyTyped" not in c10
    assert "--minShapes=images:1x3x640x640" in c10 and "--optShapes=images:8x3x640x640" in c10
    assert "--maxShapes=images:8x3x640x640" in c10 and "--timingCacheFile=m.cache" in c10
    assert "--skipInference" in c10
    c86 = trtexec.build_command("m.onnx", "m.engine", version=(8, 6), **shapes)
    assert "--fp16" in c86 and "--int8" in c86
    fp16 = trtexec.build_command("m.onnx", "m.engine", version="10.3", int8=False)
    assert "--fp16" in fp16 and "--int8" not in fp16 and not any(a.startswith("--minShapes") for a in fp16)
    strong10 = trtexec.build_command("m.onnx", "m.engine", version="10.8", strongly_typed=True)
    assert "--stronglyTyped" in strong10 and "--fp16" not in strong10 and "--int8" not in strong10
    for v in ("11.0", "11.4.1", (11, 1)):  # strongly typed is the only mode; --stronglyTyped is a deprecated no-op
        c11 = trtexec.build_command("m.onnx", "m.engine", version=v, **shapes)
        assert not {"--stronglyTyped", "--fp16", "--int8", "--best"} & set(c11)
    with pytest.raises(QATError, match="no --stronglyTyped"):
        trtexec.build_command("m.onnx", "m.engine", version="8.6", strongly_typed=True)
    g = trtexec.build_command("m.onnx", "m.engine", version="10.3", graph_prefix="m.engine", workspace_mib=4096)
    assert {"--exportLayerInfo=m.engine.layer.json", "--exportProfile=m.engine.profile.json",
            "--profilingVerbosity=detailed", "--memPoolSize=workspace:4096", "--separateProfileRun"} <= set(g)
    assert "--skipInference" not in g
    g11 = trtexec.build_command("m.onnx", "m.engine", version="11.1", graph_prefix="m.engine")
    assert "--profilingVerbosity=detailed" in g11 and "--separateProfileRun" not in g11  # always separate on 11
    p = trtexec.build_command("m.onnx", "m.engine", version="10.3", plugins=["libA.so", "libB.so"])
    assert "--staticPlugins=libA.so" in p and "--staticPlugins=libB.so" in p and "--plugins=libA.so" not in p
    with pytest.raises(QATError, match="all three"):
        trtexec.build_command("m.onnx", "m.engine", version="10.3", min_shape=(1, 3, 64, 64))


def test_benchmark_command():
    e = trtexec.benchmark_command("m.engine", batch=4, version="10.3")
    assert e == ["trtexec", "--loadEngine=m.engine", "--shapes=images:4x3x640x640", "--warmUp=500", "--duration=10",
                 "--useCudaGraph", "--useSpinWait", "--noDataTransfers"]
    # TensorRT 11: CUDA graphs, spin wait and no data transfers are the defaults; the flags are deprecated no-ops
    e11 = trtexec.benchmark_command("m.engine", batch=4, version="11.1", plugins=["libyolo.so"])
    assert e11 == ["trtexec", "--loadEngine=m.engine", "--shapes=images:4x3x640x640", "--staticPlugins=libyolo.so",
                   "--warmUp=500", "--duration=10"]
    static_onnx = trtexec.benchmark_command("m.onnx", batch=1, version="10.3", shape=None)
    assert not any(a.startswith(("--minShapes", "--optShapes", "--maxShapes", "--shapes")) for a in static_onnx)
    o10 = trtexec.benchmark_command("m.onnx", batch=8, version="10.3", int8=False, shape=(3, 320, 320),
                                    warmup=200, duration=3)
    assert o10[:5] == ["trtexec", "--onnx=m.onnx", "--minShapes=images:1x3x320x320",
                       "--optShapes=images:8x3x320x320", "--maxShapes=images:8x3x320x320"]
    assert "--fp16" in o10 and "--int8" not in o10 and "--warmUp=200" in o10 and "--duration=3" in o10
    o11 = trtexec.benchmark_command("m.onnx", batch=1, version="11.0")
    assert not {"--stronglyTyped", "--fp16", "--int8", "--useCudaGraph"} & set(o11)
    static = trtexec.benchmark_command("m.engine", batch=1, version="10.3", shape=None)
    assert not any(a.startswith("--shapes") for a in static)


def test_profile_shapes():
    assert trt_common.profile_shapes([None, 3, None, None], min_batch=1, opt_batch=8, max_batch=8, imgsz=640) == (
        (1, 3, 640, 640), (8, 3, 640, 640), (8, 3, 640, 640))
    assert trt_common.profile_shapes([1, 3, 640, 640], min_batch=1, opt_batch=8, max_batch=8, imgsz=None) is None
    assert trt_common.profile_shapes([None, 3, 640, 640], min_batch=1, opt_batch=2, max_batch=4, imgsz=640)[2] == (
        4, 3, 640, 640)
    with pytest.raises(QATError, match="--imgsz"):
        trt_common.profile_shapes([None, 3, None, None], min_batch=1, opt_batch=1, max_batch=1, imgsz=None)
    with pytest.raises(QATError, match="fixed at 640x640"):
        trt_common.profile_shapes([None, 3, 640, 640], min_batch=1, opt_batch=1, max_batch=1, imgsz=320)


def test_find_trtexec(tmp_path, monkeypatch):
    monkeypatch.delenv("TRTEXEC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(QATError) as e:
        trtexec.find_trtexec(search_dirs=(str(tmp_path / "a"), str(tmp_path / "b")))
    msg = str(e.value)
    assert "not found on PATH" in msg and str(tmp_path / "a") in msg and "TRTEXEC=" in msg
    assert "python3 scripts/build_engine.py" in msg  # the Python-API alternative
    assert "/usr/src/tensorrt/bin" in trtexec.SEARCH_DIRS and "/opt/tensorrt/bin" in trtexec.SEARCH_DIRS
    exe = tmp_path / "b" / "trtexec"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\necho '&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # trtexec --help'\n")
    exe.chmod(0o755)
    assert trtexec.find_trtexec(search_dirs=(str(tmp_path / "a"), str(tmp_path / "b"))) == exe
    assert trtexec.trtexec_version(exe) == "10.3.0"
    monkeypatch.setenv("TRTEXEC", str(tmp_path / "missing"))
    with pytest.raises(QATError, match="TRTEXEC="):
        trtexec.find_trtexec()


# ============================================================================= report
def test_report_from_fixture_logs(tmp_path):
    runs = bench_report.collect_logs(DATA / "bench")
    assert set(runs) == {"FP16", "INT8"} and sorted(runs["INT8"]) == [1, 4, 8, 12]
    res = bench_report.build_results(runs, sources={"FP16": "fp16.onnx", "INT8": "qat.onnx"})
    fp16_b8, int8_b8 = res["engines"]["FP16"]["batches"]["8"], res["engines"]["INT8"]["batches"]["8"]
    assert fp16_b8["ips"] == pytest.approx(fp16_b8["throughput_qps"] * 8)
    assert int8_b8["latency_p99_ms"] == runs["INT8"][8]["latency"]["p99"]
    cmp8 = res["comparison"]["batches"]["8"]
    assert cmp8["throughput_pct"] == pytest.approx(100 * (int8_b8["throughput_qps"] / fp16_b8["throughput_qps"] - 1))
    assert cmp8["latency_p99_pct"] < 0 < cmp8["ips_pct"]
    md = bench_report.render_markdown(res)
    assert "| Device | **NVIDIA H100 80GB HBM3** |" in md and "| TensorRT | 10.3.0 |" in md
    assert "| **INT8** vs **FP16** | | | | |" in md
    assert f"| | 8 | {cmp8['latency_p99_pct']:+.1f}% | {cmp8['throughput_pct']:+.1f}% |" in md
    assert f"| **FP16** | 1 | {res['engines']['FP16']['batches']['1']['latency_p99_ms']:.3g} ms |" in md
    assert "|  | 12 |" in md and "Total Inferences (IPS)" in md
    paths = bench_report.write_report(res, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["engines"]["INT8"]["source"] == "qat.onnx"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_benchmark_script_from_logs(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_trt.py"), "--from-logs",
                        str(DATA / "bench"), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Latency/Throughput Comparison" in r.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md", "ips.png"}
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark_trt.py"), "--from-logs",
                        str(tmp_path / "nope"), "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: log folder")


def test_benchmark_script_without_trtexec_and_dry_run(tmp_path):
    onnx = _tiny_onnx(tmp_path / "qat.onnx")
    env = _env(PATH=os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin")
    cmd = [sys.executable, str(REPO / "scripts" / "benchmark_trt.py"), "--int8", str(onnx), "--out", str(tmp_path)]
    if NO_TRTEXEC:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 2 and "trtexec was not found" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run(cmd + ["--dry-run", "--trt-version", "11.1", "--batch", "1", "4"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and not any("--stronglyTyped" in x or "--useCudaGraph" in x for x in lines)
    assert "--optShapes=images:4x3x640x640" in lines[1]
    r = subprocess.run(cmd + ["--dry-run", "--trt-version", "10.3", "--batch", "1"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0 and "--useCudaGraph" in r.stdout and "--int8" in r.stdout, r.stderr
    # a static-shape export: no shape flags (trtexec: "Static model does not take explicit shapes"), its own batch
    static = _tiny_onnx(tmp_path / "static.onnx", dynamic_hw=False, batch=1)
    base = [sys.executable, str(REPO / "scripts" / "benchmark_trt.py"), "--int8", str(static), "--out", str(tmp_path),
            "--dry-run", "--trt-version", "10.3"]
    r = subprocess.run(base + ["--batch", "1"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "Shapes" not in r.stdout and f"--onnx={static}" in r.stdout, r.stderr
    r = subprocess.run(base + ["--batch", "1", "4"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "static-shape ONNX with batch 1, so it cannot run batch 4" in r.stderr
    assert r.stdout == ""  # refused before any run
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"x")
    r = subprocess.run([*base[:3], str(bad), *base[4:], "--batch", "1"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2 and "is not a readable ONNX file" in r.stderr


# ============================================================================= shell scripts
def _tiny_onnx(path: Path, dynamic_hw: bool = True, batch: int | str = "batch", nodes: list | None = None) -> Path:
    import onnx
    from onnx import TensorProto, helper
    hw = ["height", "width"] if dynamic_hw else [320, 320]
    out = [batch, 84, "anchors" if dynamic_hw else 2100]
    g = helper.make_graph(nodes or [], "g", [helper.make_tensor_value_info("images", TensorProto.FLOAT, [batch, 3, *hw])],
                          [helper.make_tensor_value_info("output0", TensorProto.FLOAT, out)])
    onnx.save(helper.make_model(g), str(path))
    return path


def _bash(script: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(cwd / "scripts" / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env or _env())


def test_generate_trt_engine_sh(tmp_path):
    r = _bash("generate_trt_engine.sh")
    assert r.returncode == 2 and "usage:" in r.stderr
    r = _bash("generate_trt_engine.sh", str(tmp_path / "missing.onnx"), str(tmp_path / "m.engine"))
    assert r.returncode == 2 and r.stderr.startswith("error: ONNX file") and r.stderr.count("\n") == 1
    onnx = _tiny_onnx(tmp_path / "m.onnx")
    engine = tmp_path / "m.engine"
    if NO_TRTEXEC:
        r = _bash("generate_trt_engine.sh", str(onnx), str(engine), "--imgsz", "640")
        assert r.returncode == 2 and "trtexec was not found" in r.stderr and "NGC" in r.stderr
        assert not engine.exists()
    r = _bash("generate_trt_engine.sh", str(onnx), str(engine), "--imgsz", "640", "--max", "8", "--graph",
              "--dry-run", "--trt-version", "10.3")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.split()
    assert {"--fp16", "--int8", "--minShapes=images:1x3x640x640", "--optShapes=images:8x3x640x640",
            "--maxShapes=images:8x3x640x640", f"--saveEngine={engine}", f"--exportLayerInfo={engine}.layer.json",
            f"--exportProfile={engine}.profile.json", "--profilingVerbosity=detailed",
            f"--timingCacheFile={engine}.timing.cache"} <= set(cmd)
    r = _bash("generate_trt_engine.sh", str(onnx), str(engine), "--imgsz", "640", "--fp16-only", "--dry-run",
              "--trt-version", "10.3")
    assert "--fp16" in r.stdout.split() and "--int8" not in r.stdout.split()
    r = _bash("generate_trt_engine.sh", str(onnx), str(engine), "--imgsz", "640", "--dry-run", "--trt-version",
              "11.0")
    assert r.returncode == 0 and not {"--stronglyTyped", "--int8", "--fp16"} & set(r.stdout.split())
    # a graph with a plugin TensorRT does not ship: refused without its library, --staticPlugins with it
    from onnx import helper
    nmsx = helper.make_node("EfficientNMSX_TRT", ["images", "images"], ["a", "b", "c", "d", "e"], domain="TRT",
                            plugin_version="1")
    seg = _tiny_onnx(tmp_path / "seg.onnx", nodes=[nmsx])
    r = _bash("generate_trt_engine.sh", str(seg), str(engine), "--imgsz", "640", "--dry-run", "--trt-version", "10.13")
    assert r.returncode == 2 and "EfficientNMSX_TRT" in r.stderr and "not part of TensorRT" in r.stderr
    assert "--plugins" in r.stderr and r.stderr.count("\n") == 1
    lib = tmp_path / "libyolo_plugins.so"
    lib.write_bytes(b"")
    r = _bash("generate_trt_engine.sh", str(seg), str(engine), "--imgsz", "640", "--dry-run", "--trt-version", "10.13",
              "--plugins", str(lib))
    assert r.returncode == 0 and f"--staticPlugins={lib}" in r.stdout.split(), r.stderr
    r = _bash("generate_trt_engine.sh", str(seg), str(engine), "--imgsz", "640", "--dry-run", "--trt-version", "10.13",
              "--plugins", str(tmp_path / "missing.so"))
    assert r.returncode == 2 and "plugin library" in r.stderr and "not found" in r.stderr
    r = _bash("generate_trt_engine.sh", str(onnx), str(engine), "--dry-run", "--trt-version", "10.3")
    assert r.returncode == 2 and "--imgsz" in r.stderr


def test_generate_trt_engine_sh_with_a_stand_in_trtexec(tmp_path):
    """The build path end to end with a stand-in trtexec script (prints a trtexec-like log, writes a file):
    temp engine renamed into place, build log kept, ENGINE.json sidecar written from the ONNX metadata."""
    onnx = _tiny_onnx(tmp_path / "m.onnx", dynamic_hw=False)
    exe = tmp_path / "bin" / "trtexec"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n"
                   "echo '&&&& RUNNING TensorRT.trtexec [TensorRT v101300] # trtexec '\"$*\"\n"
                   "for a in \"$@\"; do case \"$a\" in --saveEngine=*) printf plan > \"${a#--saveEngine=}\";; esac; done\n"
                   "echo '&&&& PASSED TensorRT.trtexec [TensorRT v101300] # trtexec'\n")
    exe.chmod(0o755)
    engine = tmp_path / "out" / "m.engine"
    r = _bash("generate_trt_engine.sh", str(onnx), str(engine), "--max", "4", env=_env(TRTEXEC=str(exe)))
    assert r.returncode == 0, r.stderr
    assert engine.read_text() == "plan" and not list(engine.parent.glob(".*.part"))
    meta = json.loads((tmp_path / "out" / "m.engine.json").read_text())
    assert meta["tensorrt"] == "10.13.0" and meta["builder"] == "trtexec" and meta["imgsz"] == [320, 320]
    assert meta["batch"] == {"min": 1, "opt": 4, "max": 4} and meta["precision_flags"] == ["FP16", "INT8"]
    assert "PASSED" in (tmp_path / "out" / "m.engine.build.log").read_text()
    exe.write_text("#!/bin/sh\necho '[08/22/2024-10:01:10] [E] Error[4]: [network.cpp::validate] broken'\nexit 1\n")
    r = _bash("generate_trt_engine.sh", str(onnx), str(tmp_path / "bad.engine"), "--trt-version", "10.13",
              env=_env(TRTEXEC=str(exe)))
    assert r.returncode == 2 and "trtexec failed (exit 1)" in r.stderr and "broken" in r.stderr
    assert not (tmp_path / "bad.engine").exists()


@pytest.mark.skipif(not NO_TRTEXEC, reason="trtexec is installed here: the no-TensorRT failure cannot be shown")
def test_val_trt_sh_fails_clearly_without_tensorrt(tmp_path):
    weights = tmp_path / "qat_best.pt"
    weights.write_bytes(b"not used")
    data = tmp_path / "coco.yaml"
    data.write_text("val: images\n")
    r = _bash("val_trt.sh", str(weights), str(data))
    assert r.returncode == 2 and "usage:" in r.stderr
    r = _bash("val_trt.sh", str(weights), str(data), "640", "--bogus")
    assert r.returncode == 2 and "usage:" in r.stderr
    r = _bash("val_trt.sh", str(tmp_path / "missing.pt"), str(data), "640")
    assert r.returncode == 2 and r.stderr == f"error: weights file {tmp_path / 'missing.pt'} not found; pass the " \
                                             f"QAT checkpoint (e.g. runs/qat/exp/weights/qat_best.pt).\n"
    r = _bash("val_trt.sh", str(weights), str(tmp_path / "missing.yaml"), "640")
    assert r.returncode == 2 and "data yaml" in r.stderr
    r = _bash("val_trt.sh", str(weights), str(data), "abc")
    assert r.returncode == 2 and "image size" in r.stderr
    r = _bash("val_trt.sh", str(weights), str(data), "640", "--generate-graph")
    assert r.returncode == 2 and r.stderr.startswith("error: trtexec was not found") and r.stderr.count("\n") == 1
    assert not (tmp_path / "qat_best.onnx").exists()  # failed before the export


def test_val_trt_sh_exports_half_for_tensorrt_11(tmp_path):
    """TensorRT 11 builds strongly typed only: the parts that are not quantized run in FP16 only when the ONNX says
    so, so val_trt.sh exports with --half there (and not on 10). A stand-in trtexec and tensorrt package answer
    the version check; the export itself then fails on the dummy checkpoint, after the command was printed."""
    weights = tmp_path / "qat_best.pt"
    weights.write_bytes(b"not a checkpoint")
    data = tmp_path / "coco.yaml"
    data.write_text("val: images\n")
    pkg = tmp_path / "site" / "tensorrt"
    pkg.mkdir(parents=True)
    for version, tag, half in (("11.1.0", "110100", True), ("10.13.0", "101300", False)):
        (pkg / "__init__.py").write_text(f"__version__ = {version!r}\nBuilder = object\n")
        exe = tmp_path / "bin" / "trtexec"
        exe.parent.mkdir(exist_ok=True)
        exe.write_text(f"#!/bin/sh\necho '&&&& RUNNING TensorRT.trtexec [TensorRT v{tag}] # trtexec --help'\n")
        exe.chmod(0o755)
        env = _env(TRTEXEC=str(exe), PYTHONPATH=str(tmp_path / "site"))
        r = _bash("val_trt.sh", str(weights), str(data), "640", env=env)
        line = next((x for x in r.stdout.splitlines() if x.startswith("exporting")), "")
        assert f"for TensorRT {version[:-2]}" in line or f"for TensorRT {version}" in line, r.stdout + r.stderr
        assert line.rstrip().endswith("--half") == half, line
        assert r.returncode != 0  # the dummy checkpoint


@pytest.mark.skipif(not os.environ.get("YOLOV9_DIR"), reason="needs YOLOV9_DIR (a YOLOv9 tree) to patch")
def test_scripts_in_a_patched_tree(tmp_path):
    """From the top of a patched YOLOv9 tree (upstream's utils/ package + the overlay's utils/qat).

    The tree is copied and patched here (not with the yolov9_tree fixture) so that this module's own
    ``utils.qat`` imports and the fixture's sys.path/compat set-up cannot get in each other's way."""
    src = Path(os.environ["YOLOV9_DIR"]).resolve()
    if not (src / "models" / "yolo.py").is_file():
        pytest.skip(f"YOLOV9_DIR={src} is not a YOLOv9 tree")
    tree = tmp_path / "yolov9"
    shutil.copytree(src, tree, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    subprocess.run(["bash", str(REPO / "patch_yolov9.sh"), str(tree)], check=True, capture_output=True, timeout=120)
    onnx = _tiny_onnx(tmp_path / "m.onnx")
    r = _bash("generate_trt_engine.sh", str(onnx), str(tmp_path / "m.engine"), "--imgsz", "640", "--dry-run",
              "--trt-version", "10.3", cwd=tree)
    assert r.returncode == 0 and "--int8" in r.stdout, r.stderr
    if NO_TRTEXEC:
        weights = tmp_path / "w.pt"
        weights.write_bytes(b"x")
        data = tmp_path / "d.yaml"
        data.write_text("val: images\n")
        r = _bash("val_trt.sh", str(weights), str(data), "640", cwd=tree)
        assert r.returncode == 2 and r.stderr.startswith("error: trtexec was not found"), r.stderr
