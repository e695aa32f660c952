"""The Makefile's set-up refuses, before pip starts, a disk too full for the virtual environments it would install,
names what is short and how to free it, and leaves no venv behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HUGE = "100000000"  # GB: more than any disk holds


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_check_disk_passes_when_the_disk_holds_enough() -> None:
    done = _make("check-disk", "DISK_NEED_GB=0")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_check_disk_names_the_shortfall_and_the_fix() -> None:
    done = _make("check-disk", f"DISK_NEED_GB={HUGE}", "DISK_FOR=.venv")
    assert done.returncode != 0
    assert f"not enough disk for .venv: about {HUGE} GB needed" in done.stderr
    assert "make clean" in done.stderr


@pytest.mark.parametrize("venv_variable", ["VENV", "MLFLOW_VENV"])
def test_a_new_venv_is_refused_before_it_is_created(tmp_path: Path, venv_variable: str) -> None:
    venv = tmp_path / "venv"
    done = _make(f"{venv}/.installed", f"{venv_variable}={venv}", f"{venv_variable}_GB={HUGE}")
    assert done.returncode != 0
    assert f"not enough disk for {venv}" in done.stderr
    assert not venv.exists()  # nothing half-installed


def test_venvs_adds_up_what_is_still_to_install(tmp_path: Path) -> None:
    """The four venvs install at once, so the disk must hold them together: the sum is checked first."""
    missing = {name: tmp_path / name for name in ("VENV", "VLLM_VENV", "QUANTIZE_VENV", "MLFLOW_VENV")}
    sizes = {"VENV_GB": "3", "VLLM_VENV_GB": "5", "QUANTIZE_VENV_GB": "2", "MLFLOW_VENV_GB": HUGE}
    done = _make("venvs", *(f"{k}={v}" for k, v in {**missing, **sizes}.items()))
    assert done.returncode != 0
    assert f"about {int(HUGE) + 10} GB needed" in done.stderr
    assert not any(path.exists() for path in missing.values())
