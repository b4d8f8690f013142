"""Multi-process QAT on the CPU (gloo): qat.py under torch.distributed.run against one process, calibration and
fine-tuning in a process group, the device mapping, and the errors. Launches use ``--standalone`` (torchrun picks a free port)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_tool

QS = REPO / "weights" / "gelan-qs-shapes.pt"
TIMEOUT = 300  # a hang fails the test instead of blocking CI
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


def _quantize_args(data: Path, project: Path, name: str, *extra: str) -> list[str]:
    return ["qat.py", "quantize", "--weights", str(QS), "--data", str(data), "--device", "cpu", "--imgsz", "64",
            "--batch-size", "8", "--calib-batches", "2", "--workers", "2", "--project", str(project), "--name", name,
            "--exist-ok", *extra]


def _amax(ckpt: Path) -> dict[str, torch.Tensor]:
    from utils.qat.model import checkpoint
    return {k: v for k, v in checkpoint.read(ckpt)["state_dict"].items() if k.endswith("_amax")}


def _one_process(argv: list[str]) -> Path:
    """qat.py in this process with one thread, as torchrun gives each of its processes: CPU convolutions
    then round alike, and amax from the same images compares exactly."""
    import qat
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return qat.main(qat.get_args_parser().parse_args(argv[1:]))
    finally:
        torch.set_num_threads(threads)


# ---- qat.py quantize on 2 processes vs 1, through benchmarks/cost.py --mode ddp (max calibration, 1 QAT epoch) ---

@pytest.fixture(scope="module")
def bench(yolov9_tree, shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    r = run_tool(yolov9_tree, str(REPO / "benchmarks" / "cost.py"), "--mode", "ddp", "--device", "cpu", "--weights",
                 str(QS), "--data", str(shapes), "--imgsz", "64", "--batch-size", "8", "--epochs", "1", "--iters", "2",
                 "--calib-batches", "2", "--workers", "2", "--out", str(out), timeout=2 * TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    return out, r


@pytest.mark.slow
@pytest.mark.ddp
def test_two_processes_write_one_run(bench):
    out, _ = bench
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["1proc", "2proc"]  # rank 1 made no folder of its own
    run = out / "runs" / "2proc"
    report = json.loads((run / "report.json").read_text())
    assert report["world_size"] == 2 and report["calibration_seconds"] > 0
    assert [m["name"] for m in report["models"]] == ["PTQ", "QAT"] and len(report["epochs"]) == 1
    weights = sorted(p.name for p in (run / "weights").iterdir())
    assert weights[0].startswith("ptq_ap_") and weights[1].startswith("qat_best_") and weights[2].startswith("qat_ep_1_")
    assert len(weights) == 3
    assert json.loads((out / "runs" / "1proc" / "report.json").read_text())["world_size"] == 1


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_hosts(yolov9_tree, shapes, bench, tmp_path_factory):
    """The bench's 2-process run again as two "hosts" of one process each: two torchrun launches with
    ``--nnodes 2`` meeting at a c10d rendezvous on localhost, each with its own node rank (gloo, CPU)."""
    import importlib.util
    import subprocess
    import sys
    spec = importlib.util.spec_from_file_location("cost_bench", REPO / "benchmarks" / "cost.py")
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    from parts import ddp  # benchmarks/parts/, on sys.path once cost.py is loaded
    out, _ = bench
    settings = json.loads((out / "ddp.json").read_text())["settings"]  # its paths are written as $REPO, $TMPDIR
    args = cost.get_args_parser().parse_args(
        ["--mode", "ddp", "--weights", str(QS), "--data", str(shapes), "--out", str(out), "--device", "cpu"]
        + [x for k in ("imgsz", "batch_size", "epochs", "iters", "calib_method", "calib_batches")
           for x in (f"--{k.replace('_', '-')}", str(settings[k]))] + ["--workers", "2"])
    cost.check(args)
    project = tmp_path_factory.mktemp("hosts")
    command = ddp.qat_command(args, 2, project / "runs")
    argv = command[command.index("qat.py"):]  # the run's own arguments, after torchrun's
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "YOLOV9_QAT_AMAX_DUMP": str(project / "amax")}
    hosts = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "two-hosts",
                               "--rdzv-endpoint", f"localhost:{port}", *argv],
                              cwd=yolov9_tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    results = [host.communicate(timeout=2 * TIMEOUT) for host in hosts]
    for host, (stdout, stderr) in zip(hosts, results):
        assert host.returncode == 0, stderr[-3000:] + stdout[-3000:]
    return project, out / "runs" / "2proc", results


@pytest.mark.slow
@pytest.mark.ddp
def test_two_hosts_repeat_the_two_process_run(two_hosts):
    """One process on each of two "hosts" is the 2-process run of one host: the same files, the same quantizers
    after calibration, the same QAT weights; rank 0 alone wrote, and printed the results."""
    project, single_host, results = two_hosts
    run = project / "runs" / "2proc"
    assert sorted(p.name for p in (project / "runs").iterdir()) == ["2proc"]
    names = sorted(p.name for p in (run / "weights").iterdir())
    assert names == sorted(p.name for p in (single_host / "weights").iterdir())
    assert json.loads((run / "report.json").read_text())["world_size"] == 2
    from utils.qat.model import checkpoint
    for name in names:
        a, b = (checkpoint.read(d / "weights" / name)["state_dict"] for d in (run, single_host))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    ranks = [json.loads((project / "amax" / f"amax_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    printed = [stdout for stdout, _ in results if "INT8 QAT vs Origin" in stdout or "| QAT |" in stdout]
    assert len(printed) == 1  # the results table comes from global rank 0 alone


@pytest.mark.slow
@pytest.mark.ddp
def test_max_calibration_equals_one_process(bench):
    """Same global batches: the 2-process PTQ checkpoint holds exactly the amax of the one-process one, and
    both ranks held the same quantizers."""
    out, _ = bench
    one, two = (_amax(next((out / "runs" / n / "weights").glob("ptq_*.pt"))) for n in ("1proc", "2proc"))
    assert one.keys() == two.keys() and len(one) > 300
    assert all(torch.equal(one[k], two[k]) for k in one)
    ranks = [json.loads((out / "amax_2proc" / f"amax_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]


@pytest.mark.slow
@pytest.mark.ddp
def test_benchmark_report(bench):
    out, r = bench
    text = (out / "ddp.json").read_text()
    result = json.loads(text)
    assert result["command"].startswith("python3 $REPO/benchmarks/cost.py --mode ddp --device cpu --weights "
                                        "$REPO/weights/gelan-qs-shapes.pt ")
    assert str(REPO) not in text and str(out) not in text  # as anyone can run it: no path of this machine
    assert result["amax_vs_1proc"]["max_abs"] == 0 and result["amax_across_ranks"]["max_abs"] == 0
    assert result["run_2"]["world_size"] == 2 and result["speedup"] > 0
    assert set(result["qat_seconds_per_epoch"]) == {"1", "2"}
    md = (out / "ddp.md").read_text()
    assert "| QAT seconds per epoch (mean) |" in md and "| epoch 1: loss, AP, seconds |" in md and md in r.stdout


# ---- calibration and fine-tuning in a process group vs one process (tests/ddp_finetune.py) -------------------

@pytest.fixture(scope="module")
def library_runs(yolov9_tree, tmp_path_factory):
    """tests/ddp_finetune.py on 2 processes (each rank's results) and in this process (the reference)."""
    import ddp_finetune
    out = tmp_path_factory.mktemp("ddp-library")
    r = run_tool(yolov9_tree, *TORCHRUN, str(REPO / "tests" / "ddp_finetune.py"), str(out), timeout=TIMEOUT,
                 env={"PYTHONPATH": str(yolov9_tree)})
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(out / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun gives each process: CPU convolutions then round alike
    try:
        one = ddp_finetune.results()
    finally:
        torch.set_num_threads(threads)
    return one, ranks


@pytest.mark.slow
@pytest.mark.ddp
def test_calibration_in_process_group(library_runs):
    """Rank 0 calibrates on the global batches and sends its amax: max and mse alike, both ranks hold exactly
    the one-process amax."""
    one, (r0, r1) = library_runs
    for method in ("max", "mse"):
        assert r0[f"{method}_amax"].keys() == r1[f"{method}_amax"].keys() == one[f"{method}_amax"].keys()
        assert len(one[f"{method}_amax"]) > 100
        for r in (r0, r1):
            assert all(torch.equal(one[f"{method}_amax"][k], r[f"{method}_amax"][k]) for k in one[f"{method}_amax"])


@pytest.mark.slow
@pytest.mark.ddp
def test_finetune_in_process_group(library_runs):
    """DDP on 2 x half of every batch = one process on the whole batch: after 2 epochs x 3 steps the weights
    agree to float noise (Adam amplifies it: measured 1.1e-6, 1% of one step of lr 1e-4; wrong halves or
    unaveraged gradients move weights by about a step per iteration) and the losses to 1e-5."""
    import ddp_finetune
    one, (r0, r1) = library_runs
    assert one["losses"] == pytest.approx(r0["losses"], rel=1e-5) and r0["losses"] == r1["losses"]
    lr = ddp_finetune.LR
    moved = max(float((one["state"][k] - one["start"][k]).abs().max()) for k in one["state"])
    diff = max(float((one["state"][k] - r0["state"][k]).abs().max()) for k in one["state"])
    assert moved > lr and diff <= 0.05 * lr
    assert all(torch.equal(r0["state"][k], r1["state"][k]) for k in r0["state"])  # DDP keeps the ranks in step


# ---- devices and errors ----------------------------------------------------------------------------------------

def _launch(rank=0, world=2, local_world=2):
    from utils.qat.core.distributed import Launch
    return Launch(rank=rank, local_rank=rank, world_size=world, local_world_size=local_world)


def test_launch_from_env():
    from utils.qat.core.distributed import Launch, launch_from_env
    from utils.qat.core.errors import QATError
    assert launch_from_env({}) is None
    assert launch_from_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) is None  # --nproc_per_node 1
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert launch_from_env(env) == Launch(rank=3, local_rank=1, world_size=4, local_world_size=2)
    with pytest.raises(QATError, match="not integers"):
        launch_from_env({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"})


def test_device_mapping(monkeypatch):
    """Under torchrun the listed GPUs become the visible ones, in order; local rank r runs on cuda:r."""
    from utils.qat.core.device import select_device
    from utils.qat.core.errors import QATError
    def cuda_runtime_count():  # what cuInit would see: the GPUs CUDA_VISIBLE_DEVICES names, on an 8-GPU host
        return len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) if "CUDA_VISIBLE_DEVICES" in os.environ else gpus[0]

    gpus = [8]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus[0])
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", cuda_runtime_count, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert select_device("2,5", _launch(1)) == torch.device("cuda:1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")  # indices are the user's view of their own list
    assert select_device("cuda:2,0", _launch(0)) == torch.device("cuda:0")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7,4"
    assert select_device("", _launch(1)) == torch.device("cuda:1")
    assert select_device("cpu", _launch(1)) == torch.device("cpu")
    with pytest.raises(QATError, match="lists 3 GPUs but torch.distributed.run started 2 processes.*--nproc_per_node 3"):
        select_device("0,1,2", _launch())
    with pytest.raises(QATError, match="lists a GPU twice"):
        select_device("1,1", _launch())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    with pytest.raises(QATError, match="no GPU 3 .CUDA_VISIBLE_DEVICES=4,6,7"):
        select_device("0,3", _launch())
    gpus[0] = 1
    with pytest.raises(QATError, match="started 2 processes on this node but it has 1 GPU; pass --nproc_per_node 1"):
        select_device("", _launch())
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1)  # CUDA drops GPU 5 of "0,5" on a 2-GPU host
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(QATError, match="only 1 of the 2 listed GPUs exist"):
        select_device("0,5", _launch())
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 8)  # CUDA started with all 8 GPUs before
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match="CUDA started before select_device"):
        select_device("2,3", _launch())
    # a single process keeps its meaning: one GPU, and a list says how to launch
    assert select_device("0") == torch.device("cuda:0")
    with pytest.raises(QATError, match=r"`python -m torch.distributed.run --nproc_per_node 2 qat.py quantize \.\.\. --device 0,1`"):
        select_device("0,1", multi_gpu="qat.py quantize")
    with pytest.raises(QATError, match="this command runs on one"):
        select_device("0,1")


def test_errors_before_any_process_starts(yolov9_tree, shapes, tmp_path, monkeypatch):
    """Raised identically on every rank before the process group exists, with nothing written."""
    import qat
    from utils.qat.core.errors import QATError

    def main(*argv):
        return qat.main(qat.get_args_parser().parse_args(list(argv)))

    with pytest.raises(QATError, match="python -m torch.distributed.run --nproc_per_node 2 qat.py quantize"):
        main(*_quantize_args(shapes, tmp_path, "a")[1:], "--device", "0,1")
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(QATError, match="global batch and must split evenly over the 2 processes.*--batch-size 6"):
        main(*_quantize_args(shapes, tmp_path, "b")[1:], "--batch-size", "7")
    for command in ("eval", "sensitive"):
        with pytest.raises(QATError, match=f"qat.py {command} runs in one process on one GPU"):
            main(command, "--weights", str(QS), "--data", str(shapes), "--device", "cpu", "--project", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.ddp
def test_error_of_every_rank_printed_once(yolov9_tree, shapes, tmp_path):
    """Every rank stops at the same check; rank 0 prints, rank 1 exits quietly (status 0, so torchrun waits
    for rank 0), and the launch fails."""
    r = run_tool(yolov9_tree, *TORCHRUN, *_quantize_args(shapes, tmp_path, "a", "--batch-size", "7"), timeout=TIMEOUT)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and "must split evenly over the 2 processes" in lines[0], r.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.ddp
def test_rank0_failure_ends_the_run(yolov9_tree, shapes, tmp_path):
    """Rank 0 alone fails (it alone creates the run folder) while rank 1 waits for calibration: one sentence,
    non-zero exit, no hang (torchrun ends rank 1)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = run_tool(yolov9_tree, *TORCHRUN, *_quantize_args(shapes, blocker, "b", "--ptq-only"), timeout=TIMEOUT)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and "cannot create the results folder" in lines[0], r.stderr[-3000:]


def test_which_rank_prints_an_error(monkeypatch, capsys):
    """run_cli on rank 1: an error every rank meets (raised before the process group, or agreed in it) exits
    quietly with status 0 (rank 0 prints it); an error of rank 1 alone is printed, status 2."""
    from utils.qat.core.errors import QATError, run_cli
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)

    def fails(every_rank):
        def main():
            e = QATError("the same sentence")
            e.every_rank = every_rank
            raise e
        return main

    for every_rank, status, printed in ((None, 0, ""), (True, 0, ""), (False, 2, "error: the same sentence\n")):
        with pytest.raises(SystemExit) as exit_:
            run_cli(fails(every_rank))
        assert exit_.value.code == status and capsys.readouterr().err == printed


def test_same_on_every_rank_without_a_group():
    from utils.qat.core.distributed import same_on_every_rank
    from utils.qat.core.errors import QATError
    with pytest.raises(QATError, match="bad") as e:
        with same_on_every_rank():
            raise QATError("bad")
    assert e.value.every_rank is None  # outside a group: every rank's by construction (run_cli)


# ---- the accuracy budget on 2 processes ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.ddp
def test_budget_on_two_processes(yolov9_tree, shapes, tmp_path):
    """qat.py quantize --max-drop under torchrun: rank 0 scores the held-out images and decides, the other rank
    follows into the same calibrations and fine-tuning epochs (a rank that went another way would hang a collective
    and fail the timeout); rank 0 alone writes the run, its budget in report.json. At 64 px with an impossible
    budget every step runs: the three other calibrations, no layer in FP (--min-int8 1), two epochs."""
    r = run_tool(yolov9_tree, *TORCHRUN, *_quantize_args(
        shapes, tmp_path, "budget", "--calib-method", "max", "--head-amax", "calibrated", "--calib-batches", "1",
        "--epochs", "2", "--iters", "2", "--max-drop", "0", "--min-int8", "1", "--holdout-fraction", "0.4"),
        timeout=2 * TIMEOUT, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["budget"]
    report = json.loads((tmp_path / "budget" / "report.json").read_text())
    budget = report["budget"]
    assert report["world_size"] == 2 and budget["holdout"]["holdout_images"] == 6
    steps = [s["step"] for s in budget["steps"]]
    # here every step runs, fine-tuning too: two epochs at the command's rate, and two more at a third of it where
    # the first rate lowered no bound (budget.RATES)
    assert steps[:4] == [1, 2, 2, 2] and steps[4:] in ([4, 4], [4, 4, 4, 4]), budget["steps"]
    assert r.stdout.count("budget step 1 (calibration)") == 1  # rank 0 alone prints
    assert (tmp_path / "budget" / "weights" / "qat_best_gelan-qs-shapes.pt").is_file()
