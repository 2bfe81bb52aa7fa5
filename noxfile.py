"""Sessions for the workspace: tests per package, lint, typecheck, build, docs, gpu, ci.

Run ``nox -s ci`` for what CI runs. Virtual environments are made by uv.

Versions: every install is constrained to ``uv.lock`` (``uv export --frozen`` of the
whole workspace, tools included: the dependency groups of the root pyproject.toml),
so CI, a developer and a user get the same versions. ``uv lock --check`` (in
``lint``) keeps the lock in step with the pyproject files; ``uv lock
--upgrade-package NAME`` moves one package.

torch: where this machine image keeps a CPU wheel of torch (``/opt/wheels``, or the
folder in ``MLA_TORCH_FIND_LINKS``), the CPU sessions install ``MLA_TORCH_SPEC``
(default ``torch==2.13.0+cpu``) from it instead of the lock's torch (the CUDA build
that vLLM 0.33 pins), which avoids a multi-GB CUDA download on CPU-only machines;
the one pin dropped from the constraints is then torch's. Elsewhere, and in the
``vllm`` and ``gpu`` sessions, torch is the lock's. ``MLA_TRITON_SPEC`` and
``MLA_VLLM_SPEC`` override the lock's triton and vllm the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["ci"]

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
PYPROJECT = ROOT / "pyproject.toml"
TORCH_SPEC = os.environ.get("MLA_TORCH_SPEC", "torch==2.13.0+cpu")
TORCH_FIND_LINKS = os.environ.get("MLA_TORCH_FIND_LINKS", "/opt/wheels")
TRITON_SPEC = os.environ.get("MLA_TRITON_SPEC")  # default: the lock's triton
VLLM_SPEC = os.environ.get("MLA_VLLM_SPEC", "vllm==0.33.0")

# short session name -> (distribution folder, needs triton, workspace packages its tests use)
PACKAGE_SESSIONS: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "formats": ("mla-formats", False, ("mla-formats",)),
    "reference": ("mla-reference", False, ("mla-formats", "mla-reference")),
    "triton": ("mla-triton", True, ("mla-formats", "mla-reference", "mla-triton")),
    "report_tests": (
        "mla-report",
        True,
        ("mla-formats", "mla-reference", "mla-triton", "mla-report"),
    ),
}


def _cpu_torch() -> bool:
    """True where the CPU wheel of torch is at hand (see the module docstring)."""
    links = Path(TORCH_FIND_LINKS)
    return links.is_dir() and any(links.glob("torch-*.whl"))


def _name(spec: str) -> str:
    """The normalized distribution name of a requirement such as ``torch==2.13.0+cpu``."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    return re.sub(r"[-_.]+", "-", match.group(0) if match else spec).lower()


def _use_lock(session: nox.Session, *, lock_torch: bool = False) -> None:
    """Constrain every install of ``session`` to uv.lock (``UV_CONSTRAINT``).

    The lock's pins of whatever this session installs from elsewhere (the CPU torch
    wheel, unless ``lock_torch``; an ``MLA_TRITON_SPEC`` or ``MLA_VLLM_SPEC``
    override) are left out. ``UV_CONSTRAINT`` reaches uv wherever the session calls
    it: ``session.install``, ``uv pip install`` into other venvs and ``python -m
    build --installer uv``'s build environments.
    """
    exported = session.run(
        "uv", "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--all-packages",
        "--all-groups", "--all-extras", "--no-header", "--no-annotate", "--quiet",
        "--project", str(ROOT), silent=True, external=True,
    )  # fmt: skip
    assert isinstance(exported, str)
    drop = set()
    if _cpu_torch() and not lock_torch:
        drop.add("torch")
    if TRITON_SPEC:
        drop.add(_name(TRITON_SPEC))
    if VLLM_SPEC != "vllm==0.33.0":
        drop.add("vllm")
    lines = [line for line in exported.splitlines() if _name(line) not in drop]
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    session.env["UV_CONSTRAINT"] = str(path)


def _torch_args() -> list[str]:
    if _cpu_torch():
        return ["--find-links", TORCH_FIND_LINKS, TORCH_SPEC]
    return ["torch"]


def _install_base(session: nox.Session, *, triton: bool = False) -> None:
    """The lock's constraints, then torch (and, given ``MLA_TRITON_SPEC``, triton)."""
    _use_lock(session)
    session.install(*_torch_args())
    if triton and TRITON_SPEC:
        session.install(TRITON_SPEC)


def _pin_triton(session: nox.Session) -> None:
    """Given ``MLA_TRITON_SPEC``, install that Triton again, last; print the version in use.

    Called after the workspace packages: installing them moves a Triton outside
    mla-triton's declared range back into it, and trying a Triton the range does not
    admit yet (``MLA_TRITON_SPEC=triton==3.9.0 nox -s triton``) is how a range is widened.
    """
    if TRITON_SPEC:
        session.install(TRITON_SPEC)
    session.run("python", "-c", "import triton; print('triton', triton.__version__)", silent=False)


def _group(name: str) -> list[str]:
    """``session.install`` arguments of a dependency group of the root pyproject.toml."""
    return ["--group", f"{PYPROJECT}:{name}"]


def _local(dist: str) -> str:
    return str(PACKAGES / dist)


def _existing_packages() -> list[str]:
    return sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").is_file())


def _editable_args(packages: tuple[str, ...] | None = None) -> list[str]:
    """``-e`` arguments for ``packages`` (default: every package that needs no vLLM)."""
    if packages is None:
        packages = tuple(p for p in _existing_packages() if p != "mla-vllm")
    args: list[str] = []
    for package in packages:
        args += ["-e", _local(package)]
    return args


def _make_test_session(short: str, dist: str, triton: bool, uses: tuple[str, ...]) -> None:
    def run_tests(session: nox.Session) -> None:
        _install_base(session, triton=triton)
        session.install(*_group("test"), *_editable_args(uses))
        if triton:
            _pin_triton(session)
        env = {"TRITON_INTERPRET": "1"} if triton else {}
        # the interpreter is one busy core a process: one worker per core (pytest-xdist)
        workers = ["-n", "auto"] if triton else []
        session.run("pytest", _local(dist) + "/tests", *workers, *session.posargs, env=env)

    run_tests.__doc__ = f"Run {dist}'s tests (CPU{', Triton interpreter' if triton else ''})."
    nox.session(name=short)(run_tests)


for _short, (_dist, _triton, _uses) in PACKAGE_SESSIONS.items():
    if (PACKAGES / _dist / "pyproject.toml").is_file():
        _make_test_session(_short, _dist, _triton, _uses)


if (ROOT / "tests-integration").is_dir():

    @nox.session
    def integration(session: nox.Session) -> None:
        """Cross-package tests: kernels against oracles, prefill against decode."""
        _install_base(session, triton=True)
        session.install(*_group("test"), *_editable_args())
        _pin_triton(session)
        session.run("pytest", "tests-integration", *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session
def report(session: nox.Session) -> None:
    """The main job: the accuracy (and, on a GPU, speed) report of every recipe.

    Installs ``mla-report``. On a CPU it runs a small default through the Triton
    interpreter; arguments after ``--`` go to ``mla-report`` (``nox -s report -- --help``).
    """
    _install_base(session, triton=True)
    session.install(*_editable_args(("mla-formats", "mla-reference", "mla-triton", "mla-report")))
    session.run("mla-report", *(session.posargs or ["--out", str(ROOT / "report")]))


@nox.session
def gpu(session: nox.Session) -> None:
    """Every GPU suite (``test_*_gpu.py``) on a CUDA machine, compiled kernels (not in CI).

    Runs with ``MLA_REQUIRE_GPU=1``, under which a GPU test that skips fails instead
    (packages/mla-triton/tests/conftest.py), and fails at once without a CUDA device.
    Torch is the lock's CUDA build. Arguments after ``--`` go to pytest.
    """
    _use_lock(session, lock_torch=True)
    session.install("torch")
    if TRITON_SPEC:
        session.install(TRITON_SPEC)
    session.install(*_group("test"), *_editable_args())
    session.run(
        "python",
        "-c",
        "import sys, torch; sys.exit(None if torch.cuda.is_available() else "
        "'nox -s gpu: no CUDA device (torch.cuda.is_available() is False)')",
    )
    env = {"MLA_REQUIRE_GPU": "1", "TRITON_INTERPRET": "0"}
    folders = [PACKAGES / p / "tests" for p in _existing_packages() if p != "mla-vllm"]
    folders.append(ROOT / "tests-integration")
    for files in (sorted(folder.glob("test_*_gpu.py")) for folder in folders):
        if files:  # one run per folder: test files of two folders may share a name
            session.run("pytest", *map(str, files), *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """uv lock --check (the lock matches every pyproject.toml); ruff check and format."""
    session.run("uv", "lock", "--check", "--project", str(ROOT), external=True)
    _use_lock(session)
    session.install(*_group("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's src (mla-vllm's: in the vllm session)."""
    _install_base(session, triton=True)
    session.install(*_group("typecheck"), *_editable_args())
    sources = [str(PACKAGES / p / "src") for p in _existing_packages() if p != "mla-vllm"]
    session.run("mypy", *sources)


# Packages that may not be installed beside a wheel installed alone (its declared
# dependencies only): proves a package needs no more than it declares.
ABSENT_BESIDE = {
    "mla_formats": ("mla_reference", "mla_triton", "mla_report", "rich", "matplotlib"),
    "mla_reference": ("mla_triton", "mla_report", "rich", "matplotlib"),
    "mla_triton": ("mla_reference", "mla_report", "rich", "matplotlib"),
}


@nox.session
def build(session: nox.Session) -> None:
    """Build every sdist and wheel, twine check, then install each wheel alone and smoke it.

    Each wheel goes into its own venv with torch and nothing but its declared
    dependencies (the other workspace wheels from dist/); tests-smoke/smoke.py then
    imports it, makes one real call and checks that the packages it must not need
    are absent (mla-triton: torch, triton and mla-formats only; no mla-reference,
    rich or matplotlib).
    """
    _use_lock(session)
    session.install(*_group("build"))
    dist = ROOT / "dist"
    if dist.exists():
        for old in dist.iterdir():
            old.unlink()
    for package in _existing_packages():
        session.run(
            "python", "-m", "build", "--installer", "uv", "--outdir", str(dist), _local(package)
        )
    session.run("twine", "check", "--strict", *(str(p) for p in sorted(dist.iterdir())))
    # LICENSE in every wheel and sdist, Project-URLs, the docs link, a bounded Triton range
    session.run("python", str(ROOT / "tests-smoke" / "check_dist.py"), str(dist))
    tmp = Path(session.create_tmp())
    for wheel in sorted(dist.glob("*.whl")):
        module = wheel.name.split("-")[0]
        if module == "mla_vllm":
            continue  # needs vllm==0.33.0 and its CUDA torch: installed and tested by `vllm`
        venv = tmp / f"alone-{module}"
        session.run("uv", "venv", "--quiet", "--clear", str(venv), external=True)
        python = str(venv / "bin" / "python")
        pip = ["uv", "pip", "install", "--quiet", "--python", python]
        session.run(*pip, *_torch_args(), external=True)
        session.run(*pip, "--find-links", str(dist), str(wheel), external=True)
        absent = ",".join(ABSENT_BESIDE.get(module, ()))
        smoke = str(ROOT / "tests-smoke" / "smoke.py")
        session.run(
            python, smoke, module, *([f"--absent={absent}"] if absent else []), external=True
        )


@nox.session
def docs(session: nox.Session) -> None:
    """Build the mkdocs-material site in strict mode; lint the release workflow."""
    _use_lock(session)
    session.install(*_group("docs"))
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(ROOT / "site"),
        env={"NO_MKDOCS_2_WARNING": "1"},
    )
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    session.run(
        "check-jsonschema", "--builtin-schema", "vendor.github-workflows", *map(str, workflows)
    )


@nox.session
def docs_examples(session: nox.Session) -> None:
    """Run every code block of docs/ and the READMEs; check the mla_quant reference, links.

    Python blocks run on the CPU through Triton's interpreter (tests-docs/blocks.py: the
    markers). On a CUDA machine ``nox -s docs_examples -- -m gpu`` runs the GPU blocks.
    """
    _install_base(session, triton=True)
    session.install(*_group("test"), *_editable_args(), "pyyaml")
    session.run("pytest", "tests-docs", "-n", "auto", *session.posargs)


@nox.session
def e2e_checks(session: nox.Session) -> None:
    """The vLLM e2e's checks and quantized bounds on its recorded run (CPU, no vLLM)."""
    session.install(*_group("test"))
    session.run("pytest", str(ROOT / "tests-vllm-e2e" / "tests"), *session.posargs)


@nox.session
def ci(session: nox.Session) -> None:
    """Everything CI runs, in order: lint, typecheck, each package's tests, build, docs."""
    names = ["lint", "typecheck"]
    names += [s for s, (d, *_) in PACKAGE_SESSIONS.items() if (PACKAGES / d).is_dir()]
    if (ROOT / "tests-integration").is_dir():
        names.append("integration")
    names.append("e2e_checks")
    if (PACKAGES / "mla-vllm").is_dir():
        names.append("vllm")
    names += ["build", "docs_examples", "docs"]
    for name in names:
        session.notify(name)


# ---------------------------------------------------------------------------------------
# mla-vllm: vLLM 0.33.0 integration (sessions `vllm` and `vllm_e2e`). Kept separate from
# the sessions above: vLLM pins its own torch (2.14.0, CUDA build), so these sessions
# install it from the index rather than the CPU wheel.

VLLM_PACKAGES = ("mla-formats", "mla-reference", "mla-triton", "mla-vllm")


def _install_vllm(session: nox.Session) -> None:
    """vLLM (and its torch and triton), then the workspace packages without deps.

    Constrained to the lock, torch included (the lock's torch is vLLM's pin).
    """
    _use_lock(session, lock_torch=True)
    session.install(VLLM_SPEC, *_group("test"), *_group("typecheck"))
    # cuda-python 12.6 (a flashinfer dependency) and cuda-bindings 13 both write
    # cuda/bindings/; whichever lands last wins. vLLM's CUTLASS DSL import needs the
    # 13.x files, so reinstall cuda-bindings alone to make its files win.
    version = session.run(
        "python",
        "-c",
        "import importlib.metadata as m; print(m.version('cuda-bindings'))",
        silent=True,
    )
    if isinstance(version, str) and version.strip():
        session.install("--reinstall", "--no-deps", f"cuda-bindings=={version.strip()}")
    args: list[str] = ["--no-deps"]
    for package in VLLM_PACKAGES:
        args += ["-e", _local(package)]
    session.install(*args)
    session.install("matplotlib", "rich")  # mla-vllm's own needs (mla-compare's plot, table)


@nox.session
def vllm(session: nox.Session) -> None:
    """mla-vllm on CPU with the real vLLM 0.33.0: mypy --strict, then its tests.

    vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu), no visible GPU, Triton's interpreter.
    """
    _install_vllm(session)
    # lm-eval's command line and vllm model class, for the test of the argument path up
    # to vllm.LLM(...): the package alone and what those two modules import (no
    # datasets/pyarrow/scikit-learn: nothing is evaluated on CPU). vllm_e2e installs it whole.
    session.install("--no-deps", "lm-eval", "more-itertools")
    session.run("mypy", str(PACKAGES / "mla-vllm" / "src"))
    env = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
    # one worker per core, as the other sessions (2 cores: 4.9 min, 157 tests, 2026-12-02)
    # arguments after ``--`` naming test files or folders run those instead of the suite
    # (``nox -s vllm -- packages/mla-vllm/tests/test_compare_cli.py -k timeout``)
    named = [
        a for a in session.posargs if not a.startswith("-") and Path(a.split("::")[0]).exists()
    ]
    tests = [] if named else [_local("mla-vllm") + "/tests"]
    session.run("pytest", *tests, "-n", "auto", *session.posargs, env=env)


@nox.session
def vllm_e2e(session: nox.Session) -> None:
    """A tiny DeepSeek-V2-style model in a real vLLM engine on a CUDA GPU (not in CI).

    Fails with exit code 2 and a message when there is no GPU or no vLLM 0.33.0.
    Arguments after ``--`` go to tests-vllm-e2e/run_e2e.py (``--out``, ``--tol``). Then
    tests-vllm-e2e/measure_e2e.py: mla-compare, lm-eval and ModelOpt amax (issue 18),
    then mla-compare again against FLASHMLA (recipes none and nvfp4).
    """
    _install_vllm(session)
    session.install("lm-eval")
    session.run("python", str(ROOT / "tests-vllm-e2e" / "run_e2e.py"), *session.posargs)
    out = Path(session.create_tmp())
    measure = str(ROOT / "tests-vllm-e2e" / "measure_e2e.py")
    session.run("python", measure, "--out", str(out / "measure-e2e"))
    flashmla = ["--backend", "FLASHMLA", "--recipes", "none,nvfp4", "--skip-lm-eval"]
    session.run("python", measure, *flashmla, "--out", str(out / "measure-e2e-flashmla"))


@nox.session
def serve_bench(session: nox.Session) -> None:
    """The serving benchmark (packages/mla-vllm/benchmarks/serve.py) on a CUDA GPU (not in CI).

    Fails at once, before installing anything, without an NVIDIA device; the script
    itself exits 2 without CUDA or vLLM. Arguments after ``--`` go to serve.py
    (``--out``, ``--layers``, ``--batch``, ``--prompt``, ``--gen``, ``--configs``, ...).
    """
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        session.error(
            "serve_bench: needs a CUDA GPU (no /dev/nvidia* device here); the serving "
            "benchmark starts real vLLM engines and does not run on CPU"
        )
    _install_vllm(session)
    script = PACKAGES / "mla-vllm" / "benchmarks" / "serve.py"
    session.run("python", str(script), *session.posargs)
