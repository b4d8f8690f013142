"""The committed result sets (benchmarks/results/) as anyone can read and rerun them: no file names a path of the
machine it was made on (a command is written from $REPO, $YOLOV9_DIR, $SHARED, $WORK, ...: benchmarks/results/README.md),
every benchmark a set names exists under that name (or is one the index says has left), and benchmarks/ keeps to at
most seven scripts. Reads files only: no tree, no data."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# A machine's own folder at the start of a path: the before-stop hook's (/work/, /home/, /root/, /tmp/NAME/) and a
# little more (/tmp/NAME as a file, /opt/ virtual environments, macOS home folders, /mnt/).
MACHINE_PATH = re.compile(r"(?<![\w.$~/-])/(?:work|home|root|tmp|opt|mnt|Users)/[\w.+@=-]")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes in logs, which may stand right before a path
# Scripts that left benchmarks/ (or were renamed before the present names), as the index says; git history keeps them.
LEFT = ("qat_recipes.py", "quantizer_sensitivity.py", "search_heldout.py", "qat_step.py", "autocast.py",
        "ov_vs_ort.py")


def _texts():
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix != ".png":
            yield path, ANSI.sub(" ", path.read_text(errors="replace"))


def test_no_result_file_names_a_machines_own_path():
    found = [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {text[m.start():m.start() + 60]!r}"
             for path, text in _texts() for m in [MACHINE_PATH.search(text)] if m]
    assert not found, (f"{len(found)} result files name a machine's own path (write it from $REPO, $YOLOV9_DIR, "
                       "$SHARED or $WORK: benchmarks/parts/portable.py): " + "; ".join(found[:10]))


def test_the_check_catches_what_the_hook_catches():
    for path in ("/work/main/weights/x.pt", "/home/me/yolov9", "/root/out/c", "/tmp/w/yolov9-t-coco.pt",
                 "/tmp/coco-qat.yaml", "--model c=/tmp/x/c.pt", "/opt/torch/.venv/bin/python3",
                 "results to \x1b[1m/tmp/custom/train\x1b[0m"):
        assert MACHINE_PATH.search(ANSI.sub(" ", path)), path
    for text in ("$WORK/runs/x", "$SHARED/weights/yolov9-t-coco.pt", "$REPO/benchmarks/peers.py", "runs/tmp/x",
                 "$TMPDIR/yolov9-qat-holdout-x/fit", "/usr/lib/python3.12/contextlib.py"):
        assert not MACHINE_PATH.search(text), text


def test_every_benchmark_a_set_names_exists():
    import importlib.util
    spec = importlib.util.spec_from_file_location("diagnose", REPO / "benchmarks" / "diagnose.py")
    diagnose = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagnose)
    index = (RESULTS / "README.md").read_text()
    missing = set()
    for path, text in _texts():
        for script, sub in re.findall(r"benchmarks/(\w+\.(?:py|sh))(?: ([a-z][\w-]*))?", text):
            if script in LEFT:
                assert f"`{script}`" in index, f"{script} ({path.name}): the index must say where it went"
            elif not (REPO / "benchmarks" / script).is_file():
                missing.add(f"{script} ({path.relative_to(RESULTS)})")
            elif script == "diagnose.py" and sub not in diagnose.SUBCOMMANDS:
                missing.add(f"diagnose.py {sub} ({path.relative_to(RESULTS)})")
    assert not missing, "result sets name benchmarks that are not there: " + ", ".join(sorted(missing))


def test_benchmarks_keeps_to_seven_scripts():
    scripts = sorted(p.name for p in (REPO / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) <= 7, f"benchmarks/ holds {len(scripts)} scripts: {scripts}; a diagnostic becomes a " \
                              "subcommand of diagnose.py (its code in benchmarks/parts/), a shared piece a module there"
