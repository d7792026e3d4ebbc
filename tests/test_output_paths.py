"""The output-path policy (bertopt.output_paths) on real folders, and through the real command where a user meets
it: --force replaces only bertopt's own output of the same kind, stale temp folders are swept, the lock is
exclusive across threads and processes, a recipe's ``out:`` is honoured."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bertopt.errors import UserError
from bertopt.output_paths import check_links_inside, check_output, lock_path, output_lock, sweep_stale, temp_sibling


def _artifact_like(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "bertopt.json").write_text("{}")
    return folder


def _user_files(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "thesis.tex").write_text("years of work\n")
    return folder


def test_an_absent_output_is_returned_as_its_real_path(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert check_output(tmp_path / "link" / "x" / ".." / "o", kind="artifact") == (tmp_path / "real" / "o").resolve()


@pytest.mark.parametrize("kind, marker", [("artifact", "bertopt.json"), ("report", "validation.json"),
                                          ("spark-output", "_bertopt.json")])
def test_force_replaces_only_the_same_kind_of_own_output(tmp_path, kind, marker):
    own = tmp_path / "own"
    own.mkdir()
    (own / marker).write_text("{}")
    assert check_output(own, kind=kind, replace=True) == own.resolve()
    with pytest.raises(UserError, match=r"already exists \(a bertopt"):
        check_output(own, kind=kind, replace=False)
    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty", kind=kind, replace=True)  # nothing there to lose
    with pytest.raises(UserError, match="holds other files"):
        check_output(_user_files(tmp_path / "mine"), kind=kind, replace=True)
    other = {"artifact": "validation.json", "report": "_bertopt.json", "spark-output": "bertopt.json"}[kind]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / other).write_text("{}")  # bertopt's, but another kind of output
    with pytest.raises(UserError, match="holds other files"):
        check_output(foreign, kind=kind, replace=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is an existing file"):
        check_output(tmp_path / "file", kind=kind, replace=True)
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "years of work\n"


def test_inputs_are_compared_as_real_paths(tmp_path):
    art = _artifact_like(tmp_path / "real" / "art")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    via_link = tmp_path / "link" / "art"
    for out, message in [(art, "is the input"), (art / "tokenizer" / "..", "is the input"),
                         (art / "sub", "is inside the input"), (tmp_path / "real", "holds the input"),
                         (tmp_path / "link", "holds the input")]:
        with pytest.raises(UserError, match=message):
            check_output(out, kind="artifact", inputs=[via_link], replace=True)
    with pytest.raises(UserError, match="is the input"):  # a data file is an input too
        check_output(tmp_path / "data.parquet", kind="spark-output", inputs=[tmp_path / "data.parquet"])
    assert check_output(tmp_path / "elsewhere", kind="artifact", inputs=[via_link, "hdfs://x/y", None])


def test_json_results_replace_only_a_bertopt_result(tmp_path):
    result = tmp_path / "bench.json"
    result.write_text(json.dumps({"settings": {}, "machine": {}, "results": []}))
    assert check_output(result, kind="json") == result.resolve()
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    with pytest.raises(UserError, match="is not a bertopt JSON result"):
        check_output(tmp_path / "notes.json", kind="json")
    with pytest.raises(UserError, match="is a folder"):
        check_output(tmp_path, kind="json")


def test_sweep_removes_temp_folders_of_dead_writers_only(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process
    target = tmp_path / "out"
    orphan = tmp_path / f".out.tmp-{dead.pid}-0123abcd"
    orphan_old = tmp_path / f".out.old-{dead.pid}-89abcdef"
    live = temp_sibling(target)  # this process: alive
    other_target = tmp_path / f".other.tmp-{dead.pid}-0123abcd"
    unrecognised = tmp_path / ".out.tmp-0123abcd"  # an older bertopt's name: no pid, so never guessed at
    for folder in (target, orphan, orphan_old, live, other_target, unrecognised):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"partial")
    assert sorted(p.name for p in sweep_stale(target)) == sorted([orphan.name, orphan_old.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other_target.name,
                                                                 unrecognised.name])


def test_sweep_puts_back_the_output_a_killed_writer_had_moved_aside(tmp_path):
    """A writer SIGKILLed between moving the old output aside and moving its new one in leaves only the old one,
    under its .old name: the next writer's sweep puts it back instead of deleting the last copy."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "out"
    aside = tmp_path / f".out.old-{dead.pid}-89abcdef"
    unfinished = tmp_path / f".out.tmp-{dead.pid}-0123abcd"
    for folder, content in ((aside, b"the old output"), (unfinished, b"partial")):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(content)
    assert sorted(p.name for p in sweep_stale(target)) == sorted([aside.name, unfinished.name])
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (target / "model.onnx").read_bytes() == b"the old output"


# os.rename wrapped so that a signal arrives just after the old output was moved aside, before the new one moves in
_SWAP_INTERRUPTED = """
import os, signal, sys
from pathlib import Path
from bertopt import cli
from bertopt.output_paths import move_into_place
if sys.argv[2] == "cli":
    cli._remember_sigint(), cli._raise_on_sigterm()
real_rename, calls = os.rename, []
def rename(src, dst):
    real_rename(src, dst)
    calls.append(dst)
    if len(calls) == 1:
        os.kill(os.getpid(), getattr(signal, sys.argv[3]))
os.rename = rename
root = Path(sys.argv[1])
try:
    move_into_place(root / "new", root / "out")
except BaseException as exc:
    print(type(exc).__name__)
"""


@pytest.mark.parametrize(("handlers", "signame"), [("cli", "SIGINT"), ("cli", "SIGTERM"), ("python", "SIGINT")])
def test_a_signal_between_the_two_renames_leaves_one_whole_output(tmp_path, handlers, signame):
    """Under the CLI's handlers the signal waits until the new output is in place, then ends the run; without
    them (a Python caller, Ctrl-C) the old output is moved back. Never neither. (Without the CLI's handler SIGTERM
    ends the process at once: the sweep's case above.)"""
    for name, content in (("out", b"old"), ("new", b"new")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(content)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", _SWAP_INTERRUPTED, str(tmp_path), handlers, signame], env=env,
                          capture_output=True, text=True, timeout=60)
    raised = {"SIGINT": "KeyboardInterrupt", "SIGTERM": "Terminated"}[signame]
    assert proc.stdout.strip() == raised, proc.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    if handlers == "cli":  # the swap finished, then the signal was raised
        assert left == ["out"] and (tmp_path / "out" / "model.onnx").read_bytes() == b"new"
    else:  # the old output went back; the new one is the caller's temporary folder to remove
        assert left == ["new", "out"] and (tmp_path / "out" / "model.onnx").read_bytes() == b"old"


SCRATCH_THEN = {
    "a normal exit": "",
    "sys.exit(3)": "sys.exit(3)",
    "an uncaught error": "raise RuntimeError('boom')",
    "an interrupt": "raise KeyboardInterrupt",
}


@pytest.mark.parametrize("then", SCRATCH_THEN.values(), ids=SCRATCH_THEN.keys())
def test_a_process_scratch_folder_is_removed_when_the_process_exits(tmp_path, then):
    temp = tmp_path / "temp"
    temp.mkdir()
    code = ("import sys\nfrom bertopt.output_paths import process_scratch\n"
            "folder = process_scratch('tok')\n(folder / 'tokenizer.json').write_text('{}')\n"
            "print(folder, flush=True)\n" + then)
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    folder = Path(proc.stdout.strip())
    assert folder.parent == temp and folder.name.startswith("bertopt-tok-"), proc.stderr
    assert not folder.exists() and list(temp.iterdir()) == []


def test_the_lock_is_reentrant_in_a_thread_exclusive_across_threads_and_removed_after(tmp_path):
    out = tmp_path / "out"
    seen = []

    def other_writer():
        try:
            with output_lock(out):
                seen.append("got it")
        except UserError as exc:
            seen.append(str(exc))

    with output_lock(out) as real:
        assert real == out.resolve() and lock_path(real).is_file()
        with output_lock(out):  # run_stage, then the ArtifactWriter it leads to
            thread = threading.Thread(target=other_writer)
            thread.start()
            thread.join()
        assert lock_path(real).is_file()
    assert seen and seen[0].startswith(f"another bertopt (pid {os.getpid()}) is writing {out}; wait for it")
    assert not lock_path(out.resolve()).exists()
    lock_path(out.resolve()).write_text("12345\n")  # left by a writer killed with SIGKILL: flock died with it
    with output_lock(out):
        pass
    assert list(tmp_path.iterdir()) == []


def test_links_inside_an_input_folder_must_stay_inside(tmp_path):
    art = _artifact_like(tmp_path / "art")
    (art / "tokenizer").mkdir()
    (art / "tokenizer" / "vocab.txt").write_text("a\n")
    (art / "tokenizer" / "alias.txt").symlink_to(art / "tokenizer" / "vocab.txt")  # inside: harmless
    check_links_inside(art, "input artifact")
    (tmp_path / "secret").write_text("s\n")
    (art / "tokenizer" / "leak.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(UserError, match=r"tokenizer/leak.txt is a symbolic link to .*secret, outside the folder"):
        check_links_inside(art, "input artifact")
    (art / "tokenizer" / "leak.txt").unlink()
    (art / "up").symlink_to(tmp_path)  # a folder link counts too
    with pytest.raises(UserError, match="up is a symbolic link"):
        check_links_inside(art, "input artifact")


# -- through the real command --------------------------------------------------------------------------------
def test_force_replaces_an_earlier_artifact_of_the_stage(cli, tiny_onnx, tmp_path):
    code, out, err = cli("prune", tiny_onnx.path, "--out", tmp_path / "p")
    assert code == 0, err
    code, _, err = cli("prune", tiny_onnx.path, "--out", tmp_path / "p")
    assert code == 2 and "already exists (a bertopt artifact)" in err
    code, out, err = cli("prune", tiny_onnx.path, "--out", tmp_path / "p", "--force")
    assert code == 0 and "wrote" in out, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # nothing moved aside is left


@pytest.mark.parametrize("folder", ["empty", "artifact", "artifact/tokenizer"])
def test_force_never_replaces_the_folder_the_user_is_in(tiny_onnx, tmp_path, folder):
    """`--out . --force` run from inside an empty folder or an artifact (or `--out ..` from inside it) would delete
    the folder the shell stands in."""
    (tmp_path / "empty").mkdir()
    shutil.copytree(tiny_onnx.path, tmp_path / "artifact")
    cwd = tmp_path / folder
    out = "." if folder != "artifact/tokenizer" else ".."
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "prune", str(tiny_onnx.path), "--out", out,
                           "--force"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --out") and "would delete the folder you are working in" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert cwd.exists()


def test_a_recipe_writes_under_its_out_key_and_reruns_in_place(cli, tiny_hf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel: {tiny_hf}\nout: outs\nstages: [export]\n")
    code, _, err = cli("run", recipe, "--no-compare")
    assert code == 0, err
    assert (tmp_path / "outs" / "r" / "01-export" / "bertopt.json").is_file()
    assert not (tmp_path / "artifacts").exists()
    code, _, err = cli("run", recipe, "--no-compare")  # a recipe replaces its own stage folders
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "outs" / "r").iterdir()) == ["01-export"]
    code, _, err = cli("run", recipe, "--no-compare", "--out", tmp_path / "given")  # --out wins over out:
    assert code == 0, err
    assert (tmp_path / "given" / "r" / "01-export" / "bertopt.json").is_file()


def _stat_ids(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}  # (a folder moved to another parent and back has a new mtime: its ".." changed)


@pytest.mark.parametrize("stop", ["interrupt", "failure"])
def test_a_recipe_run_that_stops_half_way_leaves_the_earlier_run_whole(tiny_hf, tmp_path, stop):
    """A re-run interrupted (or failing) after its first stage was written leaves the earlier run's folders as
    they were: never a new 01-export under an old 02-optimize that names another parent, nor an old gate report."""
    from bertopt.recipes import load_recipe, run_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel: {tiny_hf}\nstages: [export, optimize]\n"
                      "validate: {targets: 'cos_min=0.99', latency: false}\n")
    run_recipe(load_recipe(recipe), out=tmp_path / "a", compare=False)
    base = tmp_path / "a" / "r"
    assert sorted(p.name for p in base.iterdir()) == ["01-export", "02-optimize", "validation"]
    before = _stat_ids(base)
    raised = KeyboardInterrupt if stop == "interrupt" else RuntimeError

    def stop_at_the_second_stage(what, done, total):
        if done == 1:
            assert (base / "01-export").is_dir() and not (base / "02-optimize").exists()  # the new one, alone
            raise raised("stopped")

    with pytest.raises(raised):
        run_recipe(load_recipe(recipe), out=tmp_path / "a", compare=False, progress=stop_at_the_second_stage)
    assert _stat_ids(base) == before  # the same files, not rewritten
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["r"]  # nothing left aside
    run_recipe(load_recipe(recipe), out=tmp_path / "a", compare=False)  # and a whole run replaces them all
    after = _stat_ids(base)
    assert sorted(after) == sorted(before) and all(after[k] != before[k] for k in after if k.endswith(".json"))


def test_outputs_a_killed_run_left_aside_are_put_back_by_the_next(tmp_path):
    from bertopt.output_paths import put_back_set_aside

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    base = tmp_path / "r"
    (base / "01-export").mkdir(parents=True)
    (base / "01-export" / "bertopt.json").write_text("the killed run's, unfinished")
    aside = tmp_path / f".r.aside-{dead.pid}-0123abcd"
    for name in ("01-export", "02-optimize"):
        (aside / name).mkdir(parents=True)
        (aside / name / "bertopt.json").write_text("the earlier run's")
    spent = tmp_path / f".r.spent-{dead.pid}-89abcdef"  # killed while removing a finished run's old folders
    (spent / "01-export").mkdir(parents=True)
    live = temp_sibling(base, "aside")  # this process's: a live run's, left alone
    live.mkdir()
    put_back_set_aside(base)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["r", live.name])
    assert {p.parent.name: p.read_text() for p in base.glob("*/bertopt.json")} == {
        "01-export": "the earlier run's", "02-optimize": "the earlier run's"}


def test_a_recipe_checks_every_stage_folder_before_the_first_stage(cli, tiny_hf, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel: {tiny_hf}\nstages: [export, optimize]\n")
    shutil.copytree(tiny_hf, tmp_path / "a" / "r" / "02-optimize")  # a model folder, not an artifact
    code, _, err = cli("run", recipe, "--out", tmp_path / "a", "--no-compare")
    assert code == 2 and "02-optimize exists and is not a bertopt artifact" in err
    assert sorted(p.name for p in (tmp_path / "a" / "r").iterdir()) == ["02-optimize"]
