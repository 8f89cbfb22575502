"""The course as Colab gets it: no clone, `google.colab` imported, pagedlab installed by the
notebooks' own set-up cell (its Colab branch: pip, without the [notebooks] extra) -- here from a
wheel built from this checkout instead of the git URL -- and a T4: compute capability 7.5, so fp16
weights, no programmatic dependent launch, pipelines capped at Ampere's depth.

CPU (CI): the set-up cell installs the wheel into a fresh venv and imports pagedlab from it; on a
simulated T4 the course picks fp16 and says so, PDL is off and the launch settings are sm75's.
GPU (-m gpu, the device run): the same install, then the engine runs on the real GPU under a T4's
settings (capability forced to 7.5): fp16, PDL off, capped stages -- and every greedy token it picks on
Llama-3.2-1B-shaped random weights is transformers' fp32 choice or a near-tie within fp16's noise."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "notebooks" / "_src"))
import gen  # noqa: E402  (the notebooks' set-up cell, as every notebook has it)

sys.path.pop(0)

# Run at the start of every process of the simulated Colab (an import line of the venv's .pth
# file): google.colab is in sys.modules (the set-up cell's test for Colab), and with
# PAGEDLAB_FAKE_T4=1 CUDA device 0 reports itself as a T4.
BOOT = '''
import os
import google.colab  # noqa: F401
if os.environ.get("PAGEDLAB_FAKE_T4") == "1":
    # pagedlab sees a T4 (its dtype, PDL and launch-setting choices); Triton and torch still see the
    # real GPU, so the kernels compile for the chip they run on
    import sys
    import types
    import torch
    _cap, _props = torch.cuda.get_device_capability, torch.cuda.get_device_properties
    def _from_pagedlab():
        return sys._getframe(2).f_globals.get("__name__", "").startswith("pagedlab")
    def _capability(*a, **k):
        return (7, 5) if _from_pagedlab() else _cap(*a, **k)
    def _properties(*a, **k):
        p = _props(*a, **k)
        if not _from_pagedlab():
            return p
        return types.SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=15 * 2**30,
                                     multi_processor_count=p.multi_processor_count)
    torch.cuda.get_device_capability, torch.cuda.get_device_properties = _capability, _properties
'''

# After the set-up cell: what a T4 gets. On a machine without CUDA, CUDA is simulated too.
T4_PROBE = '''
import json, sys, types
import torch
assert "google.colab" in sys.modules
if not torch.cuda.is_available():
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda *a, **k: (7, 5)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        name="Tesla T4", major=7, minor=5, total_memory=15 * 2**30, multi_processor_count=40)
import pagedlab
from pagedlab import course
from pagedlab.kernels import launch, pdl
cuda = torch.device("cuda", 0)
launch.clear_device_cache()
print(json.dumps(dict(
    pagedlab=pagedlab.__file__, dtype=str(course.device_dtype()[1]), report=course.device_report(),
    pdl=pdl.effective_mode(cuda), pdl_late=pdl.effective_mode(cuda, "late"),
    stages=launch.num_stages(4, cuda), max_stages=launch.MAX_STAGES_BEFORE_AMPERE,
    solutions=str(course.pieces_path("pieces.py")), tables=course.load_h200_bench() is not None)))
'''

# On the device: the engine itself under a T4's settings. Every greedy token it picks is, teacher-
# forced, transformers' fp32 argmax or within fp16's logit noise of it (2 x the 99.99th percentile
# of |transformers fp16 - fp32| over two prompts' logits: two fp16 paths may split a closer tie).
ENGINE_PROBE = '''
import json
import torch
from pagedlab import LLM, SamplingParams
from pagedlab.kernels import pdl
from pagedlab.config import resolve_device_dtype
from pagedlab.kernels.launch import capability
from pagedlab.reference import hf_model
assert capability(torch.device("cuda", 0)) == (7, 5) and resolve_device_dtype()[1] == torch.float16
g = torch.Generator().manual_seed(3)
prompts = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in (9, 40, 3, 120)]
t4 = LLM("random:llama-3.2-1b", max_num_seqs=4, num_blocks=256, show_progress=False)
outs = t4.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
ckpt = t4.checkpoint
ref32, ref16 = hf_model(ckpt, torch.float32, "cuda"), hf_model(ckpt, torch.float16, "cuda")
with torch.no_grad():
    noise = torch.cat([(ref16(torch.tensor([p], device="cuda")).logits[0].float()
                        - ref32(torch.tensor([p], device="cuda")).logits[0]).abs().flatten() for p in prompts[:2]])
    tol = 2 * noise.kthvalue(int(noise.numel() * 0.9999)).values.item()
    gaps, exact = [], 0
    for p, o in zip(prompts, outs):
        logits = ref32(torch.tensor([p + o.token_ids], device="cuda")).logits[0, len(p) - 1:-1]
        best = logits.max(-1)
        gaps += (best.values - logits.gather(1, torch.tensor(o.token_ids, device="cuda")[:, None])[:, 0]).tolist()
        exact += int((best.indices.cpu() == torch.tensor(o.token_ids)).sum())
print(json.dumps(dict(dtype=str(t4.engine.dtype), backend=t4.model.kernels.backend, graphs=t4.engine.runner.graphs is not None,
                      pdl=pdl.effective_mode(t4.engine.device), tol=tol, gaps=gaps, exact=exact)))
'''


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """A wheel of this checkout, a fresh venv that borrows this environment's libraries (not its
    pagedlab), and a folder outside any clone; google.colab importable there."""
    tmp = tmp_path_factory.mktemp("colab")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "out", "unused"))     # links followed
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        str(src), "-w", str(dist)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = dist.glob("pagedlab-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    fake = tmp / "fake"
    (fake / "google" / "colab").mkdir(parents=True)
    (fake / "google" / "colab" / "__init__.py").write_text('"""Stands in for Colab\'s module."""\n')
    (fake / "pagedlab_colab_boot.py").write_text(BOOT)
    # the fake first, then this environment's libraries as plain path entries (their .pth files,
    # such as an editable pagedlab's finder, are not run): pip and torch are there, pagedlab is not;
    # then the boot module, imported by every process
    extra = os.environ.get("PYTHONPATH", "").split(os.pathsep)      # e.g. the device's wheels folder
    here = [p for p in sys.path if p and (p.endswith(("site-packages", "dist-packages")) or p in extra)
            and Path(p).is_dir() and not (Path(p) / "pagedlab").exists()]
    (site / "zz_colab.pth").write_text("\n".join([str(fake)] + here + ["import pagedlab_colab_boot"]) + "\n")
    outside = tmp / "content"                                   # Colab's working folder
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET", "PAGEDLAB_MODEL", "PAGEDLAB_SOLUTIONS")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PAGEDLAB_NO_INSTALL="1")
    # the pip spec as the cell has it (with the [notebooks] extra, which Colab's branch drops), the
    # wheel in place of the git URL
    spec = gen.pip_spec().split(" @ ")[0] + f" @ {wheel.as_uri()}"
    cell = gen.setup_cell().replace(f'PAGEDLAB_PIP = "{gen.pip_spec()}"', f'PAGEDLAB_PIP = "{spec}"')
    assert spec in cell and "[notebooks]" in spec, "the set-up cell's PAGEDLAB_PIP line moved"
    return dict(py=py, site=site, wheel=wheel, outside=outside, env=env, cell=cell,
                colab_spec=spec.replace("[notebooks]", ""))


def _run(colab, code, extra_env=None, timeout=600):
    env = {**colab["env"], **(extra_env or {})}
    return subprocess.run([colab["py"], "-c", code], cwd=colab["outside"], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _install(colab, extra_env=None):
    r = _run(colab, colab["cell"], extra_env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"pip install {colab['colab_spec']}\n" in r.stdout, r.stdout[-2000:]    # Colab's branch: no extra
    assert f"from {colab['site'] / 'pagedlab'}" in r.stdout, r.stdout[-2000:]
    return r


def test_setup_cell_installs_the_wheel_on_colab_and_a_t4_gets_fp16(colab):
    env = {"CUDA_VISIBLE_DEVICES": ""}
    _install(colab, env)
    r = _run(colab, T4_PROBE, env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["pagedlab"].startswith(str(colab["site"])), got
    assert got["dtype"] == "torch.float16", got
    assert "Tesla T4" in got["report"] and "compute capability 7.5" in got["report"] and "float16" in got["report"]
    assert got["pdl"] == got["pdl_late"] == "off", got                 # no PDL before Hopper, even asked for
    assert got["stages"] == got["max_stages"] < 4, got                  # pipelines capped below Ampere
    assert got["solutions"].startswith(str(colab["site"])) and got["tables"], got   # course files in the wheel


@pytest.mark.gpu
def test_engine_under_t4_settings_on_the_gpu(colab):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    env = {"PAGEDLAB_FAKE_T4": "1"}
    _install(colab, env)
    r = _run(colab, ENGINE_PROBE, env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["dtype"] == "torch.float16" and got["pdl"] == "off" and got["backend"] != "torch", got
    print(f"T4 settings on the GPU: {got['exact']} of {len(got['gaps'])} greedy tokens are fp32's argmax, the "
          f"rest within fp16's noise ({got['tol']:.4f}); largest gap {max(got['gaps']):.4f}")
    assert max(got["gaps"]) <= got["tol"], got
