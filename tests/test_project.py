"""Project contract: README quick start == CI, pins, markers, the main job's CLI."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
import torch

import flashqla

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", text, re.S)
    assert block, "README has no quick-start bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_exactly_two_quickstart_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    assert "flashqla verify" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert _readme_commands()[1] in ci.splitlines(), "the README's test command must appear verbatim in .ci/run"


def test_pins_match_the_device_bundle():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = meta["project"]["dependencies"]
    assert "tilelang==0.1.15" in deps
    extras = meta["project"]["optional-dependencies"]
    assert "flash-linear-attention==0.6.0" in extras["peers"]
    bundle = ROOT.parent / "shared" / "device" / "make-bundle"
    if bundle.exists():
        pins = re.search(r"PINS=\((.*?)\)", bundle.read_text(), re.S).group(1).split()
        for pin in ("tilelang==0.1.15", "flash-linear-attention==0.6.0", "flash-qla==0.1.3"):
            assert pin in pins, f"{pin} differs from the device bundle's PINS"
    env = (ROOT / "environment.yml").read_text()
    assert "tilelang==0.1.15" in env and "flash-linear-attention==0.6.0" in env


def test_markers_registered():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = " ".join(meta["tool"]["pytest"]["ini_options"]["markers"])
    for m in ("gpu:", "slow:", "multigpu:"):
        assert m in markers


def test_import_needs_no_gpu():
    out = subprocess.run(
        [sys.executable, "-c", "import flashqla, sys; print('tilelang' in sys.modules)"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "False", "importing flashqla must not import tilelang eagerly"


def test_verify_cli_reference_rung():
    out = subprocess.run(
        [sys.executable, "-m", "flashqla", "verify", "--skip-derivations"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reference: chunked" in out.stdout
    assert "kernel checks need a CUDA GPU" in out.stdout or "kernels: sm_90" in out.stdout


def test_cli_rejects_unknown_command():
    out = subprocess.run([sys.executable, "-m", "flashqla", "frobnicate"], capture_output=True, text=True)
    assert out.returncode != 0
    assert "invalid choice" in out.stderr


def test_verify_kernel_rung_logic_with_a_stand_in(capsys):
    """The kernel rung's table (forward and autograd, per quantity, against the fp64 recurrence)
    with the reference op on bf16 q/k/v standing in for the sm_90 op on CPU: it passes, and a
    stand-in with a wrong gradient fails it."""
    import reference
    from flashqla.verify import kernel_checks

    assert kernel_checks("small", reference.chunk_gated_delta_rule, "cpu")
    assert "dbeta" in capsys.readouterr().out

    class _Broken(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g):
            return g.clone()

        @staticmethod
        def backward(ctx, dg):
            return 2 * dg

    def broken(q, k, v, g, beta, **kw):
        return reference.chunk_gated_delta_rule(q, k, v, _Broken.apply(g), beta, **kw)

    assert not kernel_checks("small", broken, "cpu")


def test_version_flag():
    out = subprocess.run([sys.executable, "-m", "flashqla", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"flashqla {flashqla.__version__}", out
    assert f'version = "{flashqla.__version__}"' in (ROOT / "pyproject.toml").read_text()


def test_wheel_installs_only_flashqla(tmp_path):
    """The wheel's only top-level package is flashqla: the repository's faces travel inside it
    (flashqla.reference, flashqla.derivations, which `flashqla.faces` finds), with the license."""
    import zipfile

    pytest.importorskip("setuptools")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (whl,) = tmp_path.glob("flashqla-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert {n.split("/")[0] for n in names} == {"flashqla", f"flashqla-{flashqla.__version__}.dist-info"}
    for path in ("flashqla/reference/gdn/op.py", "flashqla/derivations/lemmas.py", "flashqla/ops/gdn/kernels/sm90/chunk_bwd.py",
                 "flashqla/faces.py"):
        assert path in names, path
    assert any(n.endswith("/LICENSE") for n in names)
    # every package of the repository is in the list pyproject.toml names
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in ("flashqla", "reference", "derivations") and "__pycache__" not in rel.parts:
            installed = "/".join(("flashqla",) + rel.parts) if rel.parts[0] != "flashqla" else "/".join(rel.parts)
            assert f"{installed}/__init__.py" in names, rel


def test_faces_resolve_in_the_checkout_and_by_name():
    from flashqla.faces import face

    assert face("reference").__name__ in ("reference", "flashqla.reference")
    assert hasattr(face("derivations"), "registry")
    with pytest.raises(ValueError, match="name"):
        face("bench")
