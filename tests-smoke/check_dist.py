"""Check every built wheel and sdist is fit to publish.

Usage: ``python check_dist.py DIST_DIR``; run by ``nox -s build`` after the build. For
each distribution: the repository's LICENSE (Apache-2.0) is in the wheel's
``.dist-info/licenses/`` and at the sdist's top, byte for byte; the metadata says
``License-Expression: Apache-2.0`` and carries the Project-URLs Homepage,
Documentation, Source and Changelog (the Changelog is the package's own CHANGELOG.md);
the long description (the package's README) links the documentation site; every
``triton`` requirement has an upper bound (the versions the interpreter suite was run
on: packages/mla-triton/pyproject.toml). Exits 1 with one line per problem.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO = "https://github.com/mla-quant/mla-quant"
DOCS = "https://mla-quant.github.io/mla-quant/"
URLS = ("Homepage", "Documentation", "Source", "Changelog")


def _metadata_problems(name: str, text: str) -> list[str]:
    meta = Parser().parsestr(text)
    problems: list[str] = []
    if meta.get("License-Expression") != "Apache-2.0":
        problems.append(f"License-Expression is {meta.get('License-Expression')!r}")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        problems.append("no License-File: LICENSE")
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    problems += [f"no Project-URL {key!r}" for key in URLS if key not in urls]
    package = meta["Name"]
    changelog = f"{REPO}/blob/main/packages/{package}/CHANGELOG.md"
    if urls.get("Changelog", changelog) != changelog:
        problems.append(f"Project-URL Changelog is {urls['Changelog']!r}, expected {changelog!r}")
    if urls.get("Documentation", DOCS) != DOCS:
        problems.append(f"Project-URL Documentation is {urls['Documentation']!r}")
    if DOCS not in str(meta.get_payload()):
        problems.append(f"the long description (README.md) does not link {DOCS}")
    for req in meta.get_all("Requires-Dist") or []:
        if req.split(";")[0].replace(" ", "").startswith("triton") and "<" not in req:
            problems.append(f"{req!r}: no upper bound (give the versions the suite passes on)")
    return [f"{name}: {p}" for p in problems]


def check(dist: Path) -> list[str]:
    """Every problem of the wheels and sdists in ``dist``, one line each."""
    license_text = (ROOT / "LICENSE").read_bytes()
    if b"Apache License" not in license_text or b"Version 2.0" not in license_text:
        return [f"{ROOT / 'LICENSE'}: not the Apache License 2.0"]
    problems: list[str] = []
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if not wheels or len(wheels) != len(sdists):
        problems.append(f"{dist}: {len(wheels)} wheels and {len(sdists)} sdists")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
            info += "/"
            lic = f"{info}licenses/LICENSE"
            if lic not in names:
                problems.append(f"{wheel.name}: no {lic}")
            elif z.read(lic) != license_text:
                problems.append(f"{wheel.name}: {lic} differs from the repository's LICENSE")
            meta = z.read(f"{info}METADATA").decode()
        problems += _metadata_problems(wheel.name, meta)
    for sdist in sdists:
        top = sdist.name.removesuffix(".tar.gz")
        with tarfile.open(sdist) as t:
            member = t.extractfile(f"{top}/LICENSE") if f"{top}/LICENSE" in t.getnames() else None
            if member is None:
                problems.append(f"{sdist.name}: no {top}/LICENSE")
            elif member.read() != license_text:
                problems.append(f"{sdist.name}: LICENSE differs from the repository's LICENSE")
            pkg_info = t.extractfile(f"{top}/PKG-INFO")
            assert pkg_info is not None
            problems += _metadata_problems(sdist.name, pkg_info.read().decode())
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python check_dist.py DIST_DIR", file=sys.stderr)
        return 2
    problems = check(Path(argv[0]))
    for line in problems:
        print(f"check_dist: {line}", file=sys.stderr)
    if not problems:
        print(f"check_dist: {argv[0]}: LICENSE, Project-URLs, docs link and Triton range: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
