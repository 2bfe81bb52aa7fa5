"""Sessions for the workspace: tests per package, lint, typecheck, build, docs, ci.

Run ``nox -s ci`` for what CI runs. Virtual environments are made by uv.

torch: where this machine image keeps a CPU wheel of torch (``/opt/wheels``, or the
folder in ``MLA_TORCH_FIND_LINKS``), the sessions install ``MLA_TORCH_SPEC``
(default ``torch==2.13.0+cpu``) from it, which avoids a multi-GB CUDA download on
CPU-only machines; elsewhere they take torch from the index. Triton is pinned to
the release that vLLM 0.33's torch pins (3.8), whose interpreter runs the kernels.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["ci"]

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
TRITON_SPEC = os.environ.get("MLA_TRITON_SPEC", "triton==3.8.0")
TORCH_SPEC = os.environ.get("MLA_TORCH_SPEC", "torch==2.13.0+cpu")
TORCH_FIND_LINKS = os.environ.get("MLA_TORCH_FIND_LINKS", "/opt/wheels")
TEST_TOOLS = ["pytest>=8.0", "hypothesis>=6.100", "numpy>=1.24"]
REPORT_TOOLS = ["matplotlib>=3.7", "rich>=13"]  # mla-triton's `report` extra

# short session name -> (distribution folder, needs triton, workspace packages its tests use)
PACKAGE_SESSIONS: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "formats": ("mla-formats", False, ("mla-formats",)),
    "reference": ("mla-reference", False, ("mla-formats", "mla-reference")),
    "triton": ("mla-triton", True, ("mla-formats", "mla-reference", "mla-triton")),
}


def _torch_args() -> list[str]:
    links = Path(TORCH_FIND_LINKS)
    if links.is_dir() and any(links.glob("torch-*.whl")):
        return ["--find-links", str(links), TORCH_SPEC]
    return ["torch>=2.4"]


def _install_base(session: nox.Session, *, triton: bool = False) -> None:
    session.install(*_torch_args())
    if triton:
        session.install(TRITON_SPEC)


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
        extra = REPORT_TOOLS if dist == "mla-triton" else []
        session.install(*TEST_TOOLS, *extra, *_editable_args(uses))
        env = {"TRITON_INTERPRET": "1"} if triton else {}
        session.run("pytest", _local(dist) + "/tests", *session.posargs, env=env)

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
        session.install(*TEST_TOOLS, *_editable_args())
        session.run("pytest", "tests-integration", *session.posargs, env={"TRITON_INTERPRET": "1"})


@nox.session
def report(session: nox.Session) -> None:
    """The main job: the accuracy (and, on a GPU, speed) report of every recipe.

    On a CPU it runs a small default through the Triton interpreter; arguments after
    ``--`` go to ``mla-report`` (``nox -s report -- --help``).
    """
    _install_base(session, triton=True)
    session.install(
        "-e",
        _local("mla-formats"),
        "-e",
        _local("mla-reference"),
        "-e",
        f"{_local('mla-triton')}[report]",
    )
    session.run("mla-report", *(session.posargs or ["--out", str(ROOT / "report")]))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's src."""
    _install_base(session, triton=True)
    session.install("mypy>=1.11", "numpy>=1.24", *REPORT_TOOLS)
    sources = []
    for package in _existing_packages():
        if package == "mla-vllm":
            continue  # needs vllm; checked in the vllm session
        session.install("--no-deps", "-e", _local(package))
        sources.append(str(PACKAGES / package / "src"))
    session.run("mypy", *sources)


@nox.session
def build(session: nox.Session) -> None:
    """Build every sdist and wheel, twine check, then install each wheel alone and import it."""
    session.install("build>=1.2", "twine>=5.1")
    dist = ROOT / "dist"
    if dist.exists():
        for old in dist.iterdir():
            old.unlink()
    for package in _existing_packages():
        session.run(
            "python", "-m", "build", "--installer", "uv", "--outdir", str(dist), _local(package)
        )
    session.run("twine", "check", "--strict", *(str(p) for p in sorted(dist.iterdir())))
    tmp = Path(session.create_tmp())
    for wheel in sorted(dist.glob("*.whl")):
        module = wheel.name.split("-")[0]
        if module == "mla_vllm":
            continue  # needs vllm==0.33.0 and its CUDA torch: installed and tested by `vllm`
        venv = tmp / f"alone-{module}"
        session.run("uv", "venv", "--quiet", "--clear", str(venv), external=True)
        python = str(venv / "bin" / "python")
        session.run(
            "uv", "pip", "install", "--quiet", "--python", python, *_torch_args(), external=True
        )
        session.run(
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            python,
            "--find-links",
            str(dist),
            str(wheel),
            external=True,
        )
        session.run(python, str(ROOT / "tests-smoke" / "smoke.py"), module, external=True)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the mkdocs-material site in strict mode; lint the release workflow."""
    session.install("mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "check-jsonschema>=0.29")
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
def ci(session: nox.Session) -> None:
    """Everything CI runs, in order: lint, typecheck, each package's tests, build, docs."""
    names = ["lint", "typecheck"]
    names += [s for s, (d, *_) in PACKAGE_SESSIONS.items() if (PACKAGES / d).is_dir()]
    if (ROOT / "tests-integration").is_dir():
        names.append("integration")
    if (PACKAGES / "mla-vllm").is_dir():
        names.append("vllm")
    names += ["build", "docs"]
    for name in names:
        session.notify(name)


# ---------------------------------------------------------------------------------------
# mla-vllm: vLLM 0.33.0 integration (sessions `vllm` and `vllm_e2e`). Kept separate from
# the sessions above: vLLM pins its own torch (2.14.0, CUDA build), so these sessions
# install it from the index rather than the CPU wheel.

VLLM_SPEC = os.environ.get("MLA_VLLM_SPEC", "vllm==0.33.0")
VLLM_PACKAGES = ("mla-formats", "mla-reference", "mla-triton", "mla-vllm")


def _install_vllm(session: nox.Session) -> None:
    """vLLM (and its torch and triton), then the workspace packages without deps."""
    session.install(VLLM_SPEC, *TEST_TOOLS, "mypy>=1.11")
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


@nox.session
def vllm(session: nox.Session) -> None:
    """mla-vllm on CPU with the real vLLM 0.33.0: mypy --strict, then its tests.

    vLLM's CPU platform (VLLM_TARGET_DEVICE=cpu), no visible GPU, Triton's interpreter.
    """
    _install_vllm(session)
    session.run("mypy", str(PACKAGES / "mla-vllm" / "src"))
    env = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "VLLM_TARGET_DEVICE": "cpu"}
    session.run("pytest", _local("mla-vllm") + "/tests", *session.posargs, env=env)


@nox.session
def vllm_e2e(session: nox.Session) -> None:
    """A tiny DeepSeek-V2-style model in a real vLLM engine on a CUDA GPU (not in CI).

    Fails with exit code 2 and a message when there is no GPU or no vLLM 0.33.0.
    Arguments after ``--`` go to tests-vllm-e2e/run_e2e.py (``--out``, ``--tol``).
    """
    _install_vllm(session)
    session.run("python", str(ROOT / "tests-vllm-e2e" / "run_e2e.py"), *session.posargs)
