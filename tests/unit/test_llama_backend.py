"""Which llama.cpp backend a machine builds and runs (agent/runtime/llama_backend.py), the CMake
flags each backend adds (ops/backend_flags.py), each backend's own build cache (ops/paths.py,
ops/build_llama.py) and which build the agent finds (agent/runtime/llama_binaries.py). Machines are
fakes injected into the detection; no GPU is needed."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.runtime import llama_backend
from agent.runtime.llama_backend import (
    AUTO,
    BACKENDS,
    CPU,
    CUDA,
    CUSTOM,
    METAL,
    VULKAN,
    BackendChoice,
    BackendError,
    backend_dir_name,
    choose_backend,
    detect_backend,
    find_nvcc,
    nvidia_gpu_count,
    vulkan_gpu_present,
)
from agent.runtime.llama_binaries import default_bin_dir, find_binaries
from agent.runtime.runtime_errors import RuntimeMissingError
from ops import artifacts, backend_flags, build_llama, paths, vulkan_headers
from ops.paths import FetchError

NVCC = Path("/usr/local/cuda/bin/nvcc")


def machine(
    *,
    gpus: int = 0,
    nvcc: Path | None = None,
    vulkan_gpu: bool = False,
    vulkan_sdk: bool = False,
    platform: str = "linux",
) -> BackendChoice:
    return detect_backend(
        platform=platform,
        nvidia_gpus=lambda: gpus,
        nvcc=lambda: nvcc,
        vulkan_gpu=lambda: vulkan_gpu,
        vulkan_sdk=lambda: vulkan_sdk,
    )


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DACP_CACHE_DIR", str(cache))
    for name in ("DACP_LLAMA_BIN_DIR", "LLAMA_BACKEND", "CUDA_ARCHITECTURES", "CUDACXX"):
        monkeypatch.delenv(name, raising=False)
    return cache


# --- detection -----------------------------------------------------------------------------


def test_nvcc_without_a_gpu_is_cpu() -> None:
    """This machine: the CUDA toolkit is installed, no GPU: nothing could run a CUDA build."""
    choice = machine(nvcc=NVCC)
    assert choice.backend == CPU
    assert "nvcc" in choice.why and "no NVIDIA GPU" in choice.why


def test_an_nvidia_gpu_and_nvcc_is_cuda() -> None:
    choice = machine(gpus=2, nvcc=NVCC, vulkan_gpu=True, vulkan_sdk=True)
    assert choice == BackendChoice(CUDA, f"2 NVIDIA GPU(s) and nvcc at {NVCC}")


def test_an_nvidia_gpu_without_nvcc_says_what_to_install() -> None:
    choice = machine(gpus=1)
    assert choice.backend == CPU and "install the CUDA toolkit" in choice.why


@pytest.mark.parametrize(
    ("gpu", "sdk", "expected"), [(True, True, VULKAN), (True, False, CPU), (False, True, CPU)]
)
def test_vulkan_needs_a_gpu_and_the_sdk(gpu: bool, sdk: bool, expected: str) -> None:
    assert machine(vulkan_gpu=gpu, vulkan_sdk=sdk).backend == expected


def test_macos_is_metal_and_nothing_is_cpu() -> None:
    assert machine(platform="darwin").backend == METAL
    assert machine().backend == CPU


def test_a_machine_with_no_nvidia_gpu_never_gets_cuda() -> None:
    """The real probes for everything but the GPU count (nvcc is installed here)."""
    assert detect_backend(nvidia_gpus=lambda: 0).backend != CUDA


class FakeNvml:
    def __init__(self, count: int = 0, *, fail_init: bool = False, caps: Any = ()) -> None:
        self.count, self.fail_init, self.caps = count, fail_init, list(caps)
        self.shutdown = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return tuple(self.caps[handle])  # type: ignore[return-value]

    def nvmlShutdown(self) -> None:
        self.shutdown = True


def test_nvidia_gpu_count_through_nvml() -> None:
    nvml = FakeNvml(2)
    assert nvidia_gpu_count(nvml) == 2 and nvml.shutdown
    assert nvidia_gpu_count(FakeNvml(fail_init=True)) == 0


def test_without_nvidia_ml_py_nvidia_smi_counts_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make llama`` runs the build with the system python3, which has no pynvml."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml: ImportError
    listing = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\nGPU 1: NVIDIA H100 (UUID: GPU-2)\n"
    assert nvidia_gpu_count(run=lambda argv: listing) == 2
    assert nvidia_gpu_count(run=lambda argv: "") == 0


def test_lavapipe_is_not_a_vulkan_gpu() -> None:
    cpu_only = "GPU0:\n\tdeviceType = PHYSICAL_DEVICE_TYPE_CPU\n\tdeviceName = llvmpipe\n"
    gpu = cpu_only + "GPU1:\n\tdeviceType = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU\n"
    assert not vulkan_gpu_present(lambda argv: cpu_only)
    assert vulkan_gpu_present(lambda argv: gpu)


def test_nvcc_from_cudacxx(tmp_path: Path) -> None:
    nvcc = executable(tmp_path / "bin" / "nvcc")
    assert find_nvcc({"CUDACXX": str(nvcc)}) == nvcc


# --- the choice: flag, then $LLAMA_BACKEND, then the machine --------------------------------


def detected(backend: str = CPU) -> Callable[[], BackendChoice]:
    return lambda: BackendChoice(backend, "the machine")


def test_the_flag_beats_the_environment_which_beats_the_machine() -> None:
    env = {"LLAMA_BACKEND": "vulkan"}
    assert choose_backend("cuda", env=env, detect=detected()) == BackendChoice(
        CUDA, "--llama-backend"
    )
    assert choose_backend(None, env=env, detect=detected()) == BackendChoice(
        VULKAN, "$LLAMA_BACKEND"
    )
    assert choose_backend(None, env={}, detect=detected(METAL)).backend == METAL


@pytest.mark.parametrize("deferring", ["", "auto", "AUTO", " auto "])
def test_auto_defers_to_the_next_source(deferring: str) -> None:
    env = {"LLAMA_BACKEND": deferring}
    assert choose_backend(deferring, env=env, detect=detected(METAL)).backend == METAL
    assert choose_backend(deferring, env={"LLAMA_BACKEND": "CUDA"}).backend == CUDA


@pytest.mark.parametrize(
    ("flag", "env", "said"),
    [
        ("gpu", {}, "--llama-backend='gpu' is not a llama.cpp backend"),
        (None, {"LLAMA_BACKEND": "rocm"}, "$LLAMA_BACKEND='rocm' is not a llama.cpp backend"),
        # A bad flag is reported even where the environment names a good backend.
        ("opencl", {"LLAMA_BACKEND": "cpu"}, "--llama-backend='opencl'"),
    ],
)
def test_a_bad_name_is_a_one_line_error(flag: str | None, env: dict[str, str], said: str) -> None:
    with pytest.raises(BackendError) as caught:
        choose_backend(flag, env=env, detect=detected())
    message = str(caught.value)
    assert said in message and "\n" not in message
    assert message.endswith("one of cpu, cuda, vulkan, metal, auto")


def test_each_backend_has_its_own_cache_folder_and_cpu_keeps_its_name() -> None:
    assert backend_dir_name("11434.0.0", CPU) == "11434.0.0"
    names = {backend_dir_name("11434.0.0", b) for b in BACKENDS}
    assert names == {"11434.0.0", "11434.0.0-cuda", "11434.0.0-vulkan", "11434.0.0-metal"}
    with pytest.raises(BackendError):
        backend_dir_name("11434.0.0", CUSTOM)


def test_agent_and_ops_agree_on_every_backends_cache_path(isolated: Path) -> None:
    for backend in BACKENDS:
        assert default_bin_dir(backend) == paths.llama_bin_dir(backend)
    assert paths.llama_bin_dir() == isolated.resolve() / "llama.cpp" / "11434.0.0" / "bin"
    assert paths.build_stamp_path(CUDA).parent.parent.name == "11434.0.0-cuda"


# --- CMake flags -----------------------------------------------------------------------------


def executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_toolkit(root: Path, *, cublas: bool = True, driver_stub: bool = True) -> Path:
    """A CUDA toolkit's layout; its nvcc says where it lives as the real one does."""
    nvcc = executable(root / "bin" / "nvcc", f'#!/bin/sh\necho "#$ TOP={root}/bin/.."\n')
    target = root / "targets" / "x86_64-linux"
    if cublas:
        (target / "include").mkdir(parents=True)
        (target / "include" / "cublas_v2.h").write_text("")
    if driver_stub:
        (target / "lib" / "stubs").mkdir(parents=True)
        (target / "lib" / "stubs" / "libcuda.so").write_text("")
    return nvcc


def test_cpu_vulkan_and_metal_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend_flags.backend_cmake_flags(CPU) == ()
    monkeypatch.setattr("ops.backend_flags.shutil.which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(vulkan_headers, "SYSTEM_INCLUDE_DIRS", ())
    # Headers too old (none here): the build points CMake at the fetched ones.
    assert backend_flags.backend_cmake_flags(VULKAN) == (
        "-DGGML_VULKAN=ON",
        f"-DVulkan_INCLUDE_DIR={vulkan_headers.headers_dir()}",
    )
    monkeypatch.setattr(vulkan_headers, "system_headers_suffice", lambda roots=None: True)
    assert backend_flags.backend_cmake_flags(VULKAN) == ("-DGGML_VULKAN=ON",)
    monkeypatch.setattr("ops.backend_flags.shutil.which", lambda name: None)
    with pytest.raises(FetchError, match="glslc"):
        backend_flags.backend_cmake_flags(VULKAN)
    assert backend_flags.backend_cmake_flags(METAL) == (
        "-DGGML_METAL=ON",
        "-DGGML_METAL_EMBED_LIBRARY=ON",
    )
    with pytest.raises(BackendError):
        backend_flags.backend_cmake_flags(AUTO)


def test_cuda_flags_name_the_architectures_and_the_toolkits_own_nvcc(tmp_path: Path) -> None:
    toolkit = tmp_path / "cuda-13.0"
    fake_toolkit(toolkit)
    # A wrapper script elsewhere, as /usr/local/bin/nvcc is on some machines.
    wrapper = executable(
        tmp_path / "wrapper" / "nvcc", f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n'
    )
    env = {"CUDACXX": str(wrapper), "CUDA_ARCHITECTURES": "9.0"}
    assert backend_flags.backend_cmake_flags(CUDA, env) == (
        "-DGGML_CUDA=ON",
        "-DCMAKE_CUDA_ARCHITECTURES=90",
        f"-DCMAKE_CUDA_COMPILER={toolkit.resolve()}/bin/nvcc",
        f"-DCUDAToolkit_ROOT={toolkit.resolve()}",
    )


@pytest.mark.parametrize(
    ("cublas", "stub", "said"),
    [
        (False, True, "lacks cuBLAS (cublas_v2.h), which"),
        (True, False, "lacks the driver library (libcuda.so"),
        (False, False, "lacks cuBLAS (cublas_v2.h) and the driver library"),
    ],
)
def test_a_partial_cuda_toolkit_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cublas: bool, stub: bool, said: str
) -> None:
    nvcc = fake_toolkit(tmp_path / "cuda", cublas=cublas, driver_stub=stub)
    # The toolkit alone: a machine's driver (/usr/lib/.../libcuda.so) would stand in for a stub.
    monkeypatch.setattr(backend_flags, "_SYSTEM_LIB_DIRS", ())
    env = {"CUDACXX": str(nvcc), "CUDA_ARCHITECTURES": "90"}
    with pytest.raises(FetchError) as caught:
        backend_flags.backend_cmake_flags(CUDA, env)
    message = str(caught.value)
    assert said in message and str((tmp_path / "cuda").resolve()) in message
    assert "\n" not in message


def test_a_driver_library_stands_in_for_the_toolkits_stub(tmp_path: Path) -> None:
    nvcc = fake_toolkit(tmp_path / "cuda", driver_stub=False)
    driver = tmp_path / "usr-lib"
    driver.mkdir()
    (driver / "libcuda.so").write_text("")
    root = backend_flags.toolkit_root(nvcc)
    assert backend_flags.cuda_toolkit_problem(root, system_lib_dirs=(str(driver),)) is None


def test_the_cuda_backend_without_nvcc_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_flags, "find_nvcc", lambda env: None)
    with pytest.raises(FetchError, match="the cuda backend needs nvcc"):
        backend_flags.backend_cmake_flags(CUDA, {})


@pytest.mark.parametrize(
    ("configured", "expected"),
    [
        ("90", "90"),
        ("9.0", "90"),
        ("8.6;8.9", "86;89"),
        ("90, 86 90;8.6", "90;86"),
        ("90a", "90a"),
        ("86-real", "86-real"),
        ("native", "native"),
    ],
)
def test_cuda_architectures_from_the_environment(configured: str, expected: str) -> None:
    nvml = FakeNvml(1, caps=[(7, 5)])  # not asked: the environment wins
    env = {"CUDA_ARCHITECTURES": configured}
    assert backend_flags.cuda_architectures(env, nvml_module=nvml) == expected


@pytest.mark.parametrize("configured", ["sm_90", "9", "hopper", "9.0.1"])
def test_a_bad_cuda_architecture_is_a_one_line_error(configured: str) -> None:
    with pytest.raises(FetchError) as caught:
        backend_flags.cuda_architectures({"CUDA_ARCHITECTURES": configured})
    assert "is not a CUDA architecture" in str(caught.value) and "\n" not in str(caught.value)


def test_cuda_architectures_from_the_gpus_through_nvml() -> None:
    nvml = FakeNvml(3, caps=[(9, 0), (8, 6), (9, 0)])
    assert backend_flags.cuda_architectures({}, nvml_module=nvml, run=fail) == "90;86"


def fail(argv: list[str]) -> str:
    raise AssertionError(f"not expected to run {argv}")


def test_cuda_architectures_from_nvidia_smi_where_nvml_fails() -> None:
    asked: list[list[str]] = []

    def smi(argv: list[str]) -> str:
        asked.append(argv)
        return "8.9\n8.9\n12.0\n"

    nvml = FakeNvml(fail_init=True)
    assert backend_flags.cuda_architectures({}, nvml_module=nvml, run=smi) == "89;120"
    assert asked == [["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]]


def test_no_gpu_and_no_cuda_architectures_says_to_set_it() -> None:
    with pytest.raises(FetchError) as caught:
        backend_flags.cuda_architectures({}, nvml_module=FakeNvml(0), run=lambda argv: "")
    message = str(caught.value)
    assert "set CUDA_ARCHITECTURES" in message and "\n" not in message


# --- each backend's build cache --------------------------------------------------------------


def fake_build(backend: str, stamp: dict[str, Any]) -> Path:
    bin_dir = paths.llama_bin_dir(backend)
    for name in [*build_llama.targets(backend).values(), paths.RPC_SERVER_ALIAS]:
        executable(bin_dir / name)
    paths.build_stamp_path(backend).write_text(json.dumps(stamp), encoding="utf-8")
    return bin_dir


def test_a_stamp_from_before_backends_is_still_the_cpu_build() -> None:
    """The CPU build cached before there were backends is not rebuilt (6 minutes here)."""
    legacy = {
        "dist": paths.LLAMA_DIST_NAME,
        "version": paths.LLAMA_DIST_VERSION,
        "flags": list(build_llama.CMAKE_FLAGS),
        "targets": {"llama-server": "llama-server", "ggml-rpc-server": "ggml-rpc-server"},
        "built_at": "2026-12-05T07:20:16+00:00",
    }
    bin_dir = fake_build(CPU, legacy)
    assert build_llama.cached_bin_dir() == bin_dir
    assert build_llama.expected_stamp(CPU)["backend"] == CPU


def test_another_backends_stamp_is_not_the_cpu_build() -> None:
    fake_build(CPU, build_llama.expected_stamp(CPU) | {"backend": VULKAN})
    assert build_llama.cached_bin_dir(CPU) is None


@pytest.fixture
def toolkit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    nvcc = fake_toolkit(tmp_path / "cuda")
    monkeypatch.setenv("CUDACXX", str(nvcc))
    monkeypatch.setenv("CUDA_ARCHITECTURES", "90")
    yield nvcc


def test_the_cuda_build_is_cached_on_its_own_with_its_architectures(
    toolkit: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stamp = build_llama.expected_stamp(CUDA)
    assert stamp["backend"] == CUDA and "-DCMAKE_CUDA_ARCHITECTURES=90" in stamp["flags"]
    assert stamp["flags"][: len(build_llama.CMAKE_FLAGS)] == list(build_llama.CMAKE_FLAGS)
    assert "llama-bench" in stamp["targets"]
    bin_dir = fake_build(CUDA, stamp)
    assert build_llama.cached_bin_dir(CUDA) == bin_dir
    assert bin_dir.parent.name == "11434.0.0-cuda"
    assert build_llama.cached_bin_dir(CPU) is None  # the CPU build is not there
    monkeypatch.setenv("CUDA_ARCHITECTURES", "86")  # other GPUs: another build
    assert build_llama.cached_bin_dir(CUDA) is None


def test_llama_bench_comes_with_gpu_builds_only() -> None:
    assert set(build_llama.targets(CPU)) == {"llama-server", "ggml-rpc-server"}
    for backend in (CUDA, VULKAN, METAL):
        assert set(build_llama.targets(backend)) == {
            "llama-server",
            "ggml-rpc-server",
            "llama-bench",
        }


def test_the_build_says_which_backend_and_why_first(capsys: pytest.CaptureFixture[str]) -> None:
    # Metal: the one GPU backend whose flags need nothing installed here (a vulkan stamp
    # would need glslc to compute its flags).
    fake_build(METAL, build_llama.expected_stamp(METAL))
    assert build_llama.main(["--backend", "metal"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "llama.cpp backend: metal (--backend)"
    assert out[1].startswith("llama.cpp 11434.0.0 (metal) is cached in ")
    assert out[1].endswith("11434.0.0-metal/bin")


def test_the_build_honours_llama_backend(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_build(METAL, build_llama.expected_stamp(METAL))
    monkeypatch.setenv("LLAMA_BACKEND", "metal")
    assert build_llama.main([]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "llama.cpp backend: metal ($LLAMA_BACKEND)"


def test_the_build_with_a_bad_backend_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLAMA_BACKEND", "rocm")
    assert build_llama.main([]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("build_llama: error: $LLAMA_BACKEND='rocm'") and "\n" not in err
    with pytest.raises(SystemExit) as caught:
        build_llama.main(["--backend", "rocm"])
    assert caught.value.code == 2


def test_a_cuda_build_this_machine_cannot_make_fails_before_extracting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(backend_flags, "find_nvcc", lambda env: None)
    monkeypatch.setattr(build_llama, "_sdist", fail)
    assert build_llama.main(["--backend", "cuda"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["llama.cpp backend: cuda (--backend)"]
    assert captured.err.strip().startswith("build_llama: error: the cuda backend needs nvcc")


def test_ensure_llama_builds_the_chosen_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def ensure_built(*, backend: str) -> Path:
        built.append(backend)
        return paths.llama_bin_dir(backend)

    monkeypatch.setattr(build_llama, "ensure_built", ensure_built)
    monkeypatch.setattr(llama_backend, "detect_backend", detected(CPU))
    monkeypatch.setenv("LLAMA_BACKEND", "vulkan")
    assert artifacts.ensure_llama() == paths.llama_bin_dir(VULKAN)
    assert artifacts.ensure_llama("cuda") == paths.llama_bin_dir(CUDA)
    assert built == [VULKAN, CUDA]
    with pytest.raises(BackendError, match="backend='rocm'"):
        artifacts.ensure_llama("rocm")


# --- which build the agent finds ------------------------------------------------------------


def fake_bins(directory: Path) -> Path:
    for name in ("llama-server", "ggml-rpc-server"):
        executable(directory / name)
    return directory


def test_the_agent_runs_the_chosen_backends_cached_build(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_bins(paths.llama_bin_dir(CPU))
    cuda = fake_bins(paths.llama_bin_dir(CUDA))
    monkeypatch.setenv("LLAMA_BACKEND", "cuda")
    found = find_binaries()
    assert (found.bin_dir, found.backend) == (cuda.resolve(), CUDA)
    assert find_binaries(None, "cpu").backend == CPU  # the flag beats $LLAMA_BACKEND


def test_a_missing_backend_build_names_it_and_how_to_build_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_bins(paths.llama_bin_dir(CPU))
    with pytest.raises(RuntimeMissingError) as caught:
        find_binaries(None, "cuda")
    message = str(caught.value)
    assert "\n" not in message and "11434.0.0-cuda" in message
    assert "backend from --llama-backend" in message
    assert "`python -m ops.build_llama --backend cuda`" in message
    assert "LLAMA_BACKEND=cuda make llama" in message


def test_an_operators_own_build_is_custom_unless_the_flag_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = fake_bins(tmp_path / "rocm-build")
    monkeypatch.setenv("LLAMA_BACKEND", "cuda")  # for the build cache, not for this build
    assert find_binaries(own).backend == CUSTOM
    assert find_binaries(own, "auto").backend == CUSTOM
    assert find_binaries(own, "vulkan").backend == VULKAN
    monkeypatch.setenv("DACP_LLAMA_BIN_DIR", str(own))
    assert find_binaries().backend == CUSTOM
    with pytest.raises(BackendError):
        find_binaries(own, "rocm")


def test_a_bin_dir_that_is_the_build_cache_keeps_its_backend() -> None:
    """``find_binaries(ensure_llama())``, as the end-to-end tests do."""
    cuda = fake_bins(paths.llama_bin_dir(CUDA))
    assert find_binaries(cuda).backend == CUDA
    assert find_binaries(paths.llama_bin_dir(CUDA) / ".." / "bin").backend == CUDA
