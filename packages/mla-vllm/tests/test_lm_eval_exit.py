"""``python -m mla_vllm.compare.lm_eval_run``: lm-eval's CLI, then an exit that cannot hang.

The hang it works around (seen on an H200: results written, process alive until
killed) is reproduced here by what keeps any interpreter from exiting, a non-daemon
thread that never ends: plain, the process does not exit; through the wrapper it
exits with lm-eval's code, after naming the thread.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mla_vllm.compare import lm_eval_run

SRC = str(Path(lm_eval_run.__file__).resolve().parents[2])
STUCK = """
import threading
def cli():
    threading.Thread(target=threading.Event().wait, name="stuck-worker").start()
    print("RESULTS WRITTEN", flush=True)
"""


def _python(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_a_blocking_thread_hangs_plain_exit_but_not_the_wrapper() -> None:
    with pytest.raises(subprocess.TimeoutExpired):  # the failure mode itself
        _python(STUCK + "cli()\n", timeout=2)
    done = _python(
        STUCK + "from mla_vllm.compare.lm_eval_run import main\nmain(['run'], cli=cli)\n",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "RESULTS WRITTEN" in done.stdout
    assert "1 non-daemon thread(s)" in done.stderr
    assert "thread 'stuck-worker' (Thread)" in done.stderr and "in wait" in done.stderr
    assert "shut down 0 vLLM engine(s)" in done.stderr


def test_exit_code_and_report(monkeypatch: pytest.MonkeyPatch) -> None:
    codes: list[int] = []
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)

    def fail() -> None:
        raise RuntimeError("boom")

    def leave(code: object) -> Any:
        def cli() -> None:
            raise SystemExit(code)

        return cli

    for cli, want in ((lambda: None, 0), (leave(3), 3), (leave("usage"), 1), (fail, 1)):
        lm_eval_run.main(["run"], cli=cli, exit_=codes.append)
        assert codes[-1] == want
    assert "RuntimeError: boom" in err.getvalue()
    monkeypatch.setenv(lm_eval_run.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="MLA_LM_EVAL_EXIT_TIMEOUT: expected seconds"):
        lm_eval_run.main(["run"], cli=lambda: None, exit_=codes.append)
    assert len(codes) == 4


def test_report_names_threads_and_children() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="held-open")
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stream = io.StringIO()
        state = lm_eval_run.exit_report(stream)
    finally:
        stop.set()
        child.kill()
        child.wait()
        thread.join()
    assert [t["name"] for t in state["threads"]] == ["held-open"]
    assert "in wait" in state["threads"][0]["stack"]
    mine = [c for c in state["children"] if c["pid"] == child.pid]
    assert len(mine) == 1 and "time.sleep(60)" in mine[0]["cmdline"]
    assert mine[0]["ppid"] == os.getpid() and mine[0]["state"] in "RSD"
    assert f"child pid {child.pid} " in stream.getvalue()


def test_live_engines_are_shut_down() -> None:
    import vllm

    calls: list[str] = []
    llm = object.__new__(vllm.LLM)
    core = SimpleNamespace(shutdown=lambda: calls.append("shutdown"))
    setattr(llm, "llm_engine", SimpleNamespace(engine_core=core))  # noqa: B010
    assert lm_eval_run.shutdown_engines([llm, object(), "LLM"]) == 1
    assert calls == ["shutdown"]


def test_wrapper_gives_lm_eval_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval's CLI reads ``sys.argv``: the wrapper's arguments, as given (what lm-eval
    then passes to ``vllm.LLM`` is test_lm_eval_args.py's)."""
    argv = ["run", "--model", "vllm", "--model_args", '{"attention_backend": "MLA_QUANT"}']
    seen: list[list[str]] = []
    monkeypatch.setattr(sys, "argv", ["lm_eval_run.py", "ignored"])
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    lm_eval_run.main(argv, cli=lambda: seen.append(sys.argv[1:]), exit_=lambda code: None)
    assert seen == [argv]


def _measure() -> Any:
    root = Path(__file__).resolve().parents[3] / "tests-vllm-e2e"
    sys.path.insert(0, str(root))
    try:
        import measure_e2e  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(root))
    return measure_e2e


def test_measure_diagnoses_a_process_that_outlives_its_results(tmp_path: Path) -> None:
    """measure_e2e's watcher for plain lm-eval: threads and children recorded, then SIGABRT
    makes faulthandler print the stuck thread's stack."""
    m = _measure()
    results = tmp_path / "res"
    code = f"""
    import pathlib, subprocess, sys, threading, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    threading.Thread(target=threading.Event().wait, name="stuck-worker").start()
    pathlib.Path({str(results)!r}).mkdir()
    pathlib.Path({str(results / "results_1.json")!r}).write_text("{{}}")
    """
    log = tmp_path / "plain.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONFAULTHANDLER="1"),
            start_new_session=True,
        )
    report = tmp_path / "hang.json"
    m.watch_exit(proc, results, 1.0, time.time() + 60, report)
    state = json.loads(report.read_text())
    assert proc.poll() is not None and state["pid"] == proc.pid
    assert len(state["threads"]) == 2  # main and the stuck one (named by the OS from 3.14)
    assert all(t["state"] in "RSD" and t["comm"] for t in state["threads"])
    assert [c["cmdline"] for c in state["children"]] == [
        f"{sys.executable} -c import time; time.sleep(60)"
    ]
    text = log.read_text()
    assert "Fatal Python error: Aborted" in text and "in wait" in text


def test_measure_compare_command_backend_and_recipes(tmp_path: Path) -> None:
    m = _measure()
    p = [tmp_path / n for n in ("model", "prompts", "scales", "state", "out")]
    cmd = m.compare_command(*p, 2, backend="FLASHMLA", recipes=("none", "nvfp4-ckpt"))
    recipes = [cmd[i + 1] for i, word in enumerate(cmd) if word == "--recipe"]
    assert recipes[0] == "none" and recipes[1].startswith('nvfp4-ckpt={"recipe": "nvfp4"')
    assert cmd[cmd.index("--backend") + 1] == "FLASHMLA"
    for bad in ({"recipes": ("nvfp5",)}, {"recipes": ()}, {"backend": "FLASH_ATTN"}):
        with pytest.raises(ValueError, match=r"(recipes|backend): expected"):
            m.compare_command(*p, 2, **bad)
    assert m.lm_eval_command(*p[:3])[2] == "mla_vllm.compare.lm_eval_run"
    assert m.lm_eval_command(*p[:3], plain=True)[2] == "lm_eval"
