"""Install the pack the way a user's ComfyUI Manager does, then load it in the real server.

ComfyUI Manager's command line (`python -m cm_cli`, from the comfyui-manager package)
installs only from URLs with a host, so the repository is served from loopback by
`git daemon`; Manager clones it into custom_nodes/ and installs requirements.txt.
"""
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from comfy_host import host_path
from server_harness import ComfyServer, carnator_outputs, free_port

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def git_server(tmp_path):
    served = tmp_path / "srv"
    served.mkdir()
    subprocess.run(["git", "clone", "-q", "--bare", str(REPO), str(served / "carnator.git")], check=True)
    port = free_port()
    daemon = subprocess.Popen(["git", "daemon", "--export-all", f"--base-path={served}",
                               "--listen=127.0.0.1", f"--port={port}", str(served)])
    time.sleep(1.0)
    yield f"git://127.0.0.1:{port}/carnator.git"
    daemon.terminate()
    daemon.wait(timeout=10)


def test_comfyui_manager_installs_the_pack_and_comfyui_loads_it(tmp_path, git_server):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    host = tmp_path / "ComfyUI"
    # a user's ComfyUI: no pack, and none of the bundled models in models/diffusion_models
    shutil.copytree(host_path(), host, symlinks=True, ignore=lambda d, names: (
        ["carnator"] if d.endswith("custom_nodes")
        else [n for n in names if n.startswith("carnator_")] if d.endswith("diffusion_models") else []))
    out = subprocess.run([sys.executable, "-m", "cm_cli", "install", git_server], cwd=host,
                         env={**__import__("os").environ, "COMFYUI_PATH": str(host)},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    installed = host / "custom_nodes" / "carnator"
    assert (installed / "__init__.py").is_file() and (installed / ".git").is_dir()
    assert "[INSTALLED]" in out.stdout + out.stderr

    # the README's install step: the bundled models and their calibrations placed by the command
    user = tmp_path / "run" / "user"
    out = subprocess.run([sys.executable, str(installed / "scripts" / "install_models.py"),
                          "--user-directory", str(user)], cwd=host, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    placed = {p.name for p in (host / "models" / "diffusion_models").iterdir()}
    assert {"carnator_tinyworld_wan21.safetensors", "carnator_tiny_wan21.safetensors"} <= placed, placed
    calibrations = {p.name for p in (user / "carnator_cache" / "calibration").iterdir()}
    bundled = {p.name for p in (installed / "models" / "calibration").glob("*.json")
               if re.fullmatch(r"[0-9a-f]{32}(\.probe[0-9.]+)?(\.n[0-9]+)?\.json", p.name)}  # per model, probe, N
    assert bundled <= calibrations and any(".probe" in n for n in bundled), (bundled, calibrations)
    for n_steps in (30, 50):  # the tiny world's 30- and 50-step ones too
        assert any(n.endswith(f".n{n_steps}.json") for n in bundled), bundled
    again = subprocess.run([sys.executable, str(installed / "scripts" / "install_models.py"),
                            "--user-directory", str(user)], cwd=host, capture_output=True, text=True)
    assert "copied" not in again.stdout and "already there" in again.stdout, again.stdout

    with ComfyServer(tmp_path / "run", host=host) as server:
        info = server.get("/object_info")
        assert {"CarnatorEarlyProbe", "CarnatorSampler", "CarnatorTinyWorldTextEncode"} <= set(info)
        # the first example workflow runs as shipped: the model found, its gate calibrated
        wf = json.loads((installed / "workflows" / "api" / "carnator_tinyworld_sampler.api.json").read_text())
        (summary,) = carnator_outputs(server.run(wf, timeout=600))
        assert summary["outcome"] == "miss" and summary["stored_id"], summary
        assert "gate: calibrated" in summary["calibration"], summary
        # and the video a person opens: the frames decoded and saved as an animated WEBP
        from PIL import Image
        (webp,) = (server.output_dir / "carnator").glob("tinyworld*.webp")
        with Image.open(webp) as img:
            assert getattr(img, "n_frames", 1) == 4 and img.size == (128, 128), (img.size, img.n_frames)
