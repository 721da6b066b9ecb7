"""The CUDA text of the varlen bodies compiles for the H200 (sm_90) without a GPU: NVRTC, then ptxas.

The GPU machine is lent for minutes; a syntax error, a bad inline-PTX operand or a spill
into local memory should not wait for it. The NVIDIA compiler packages of the test extra
provide libnvrtc and ptxas on Linux x86-64; elsewhere the test skips.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest

from orchard.kernels import launch, mma_decode_source, mma_source, source

nvidia = pytest.importorskip("nvidia", reason="the NVIDIA compiler packages of the test extra are not installed")
ROOTS = [Path(p) for p in nvidia.__path__]
NVRTC = next((p for root in ROOTS for p in root.glob("cuda_nvrtc/lib/libnvrtc.so*") if "alt" not in p.name), None)
PTXAS = next((p for root in ROOTS for p in root.glob("cuda_nvcc/bin/ptxas")), None)
INCLUDE = next((p for root in ROOTS for p in root.glob("cuda_runtime/include") if (p / "cuda_fp16.h").exists()), None)
if not (NVRTC and PTXAS and INCLUDE):
    pytest.skip("libnvrtc, ptxas or the CUDA headers are missing", allow_module_level=True)

PARAMS = ("const T* queries, const T* key_cache, const T* value_cache, const int* block_tables, const int* units, "
          "const float* scale, const int* dims, const int* window, const float* sinks, T* out, float* part_out, float* part_max, "
          "float* part_sum")
TEMPLATE = ("typename T, int HEAD_DIM, int BLOCK_SIZE, int NUM_KV_HEADS, int GROUP, int HEADS_PER_TILE, int Q_TOKENS, int KV_TILE, "
            "int NUM_THREADS, int SOFTCAP, int WINDOWED, int SINKS")
CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


def nvrtc_ptx(text: str) -> str:
    lib = ctypes.CDLL(str(NVRTC))
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"orchard.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17", b"-I" + str(INCLUDE).encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def kernel_text(header: str, body: str, dtype: str, constants: tuple) -> str:
    t = CUDA_TYPES[dtype]
    args = PARAMS.replace("const T*", f"const {t}*").replace("T* out", f"{t}* out")
    return (f"#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n{header}\n"
            f"template <{TEMPLATE}>\n__global__ void orchard_varlen({PARAMS}) {{\n{body}\n}}\n"
            f"template __global__ void orchard_varlen<{t}, {', '.join(map(str, constants))}>({args});\n")


#: (dtype, HEAD_DIM, BLOCK_SIZE, NUM_KV_HEADS, GROUP, HEADS_PER_TILE, Q_TOKENS, KV_TILE, NUM_THREADS) as orchard/kernels/varlen.py passes them
MMA_SHAPES = [("float16", 128, 16, 8, 4, 4, 16, 32, 128, 0, 0, 0), ("bfloat16", 64, 16, 8, 4, 4, 16, 64, 128, 0, 1, 1),
              ("float16", 64, 32, 8, 1, 1, 64, 64, 128, 0, 0, 0), ("bfloat16", 128, 16, 8, 4, 4, 16, 32, 128, 1, 1, 1)]


@pytest.mark.parametrize("dtype,constants", [(s[0], s[1:]) for s in MMA_SHAPES])
def test_tensor_core_body_compiles_for_sm90_without_local_memory(tmp_path, dtype, constants):
    header, body = mma_source.render()
    (tmp_path / "k.ptx").write_text(nvrtc_ptx(kernel_text(header, body, dtype, constants)))
    done = subprocess.run([str(PTXAS), "-arch=sm_90", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "mma.sync.aligned.m16n8k16" in (tmp_path / "k.ptx").read_text()
    frames = [int(n) for n in re.findall(r"(\d+) bytes stack frame", done.stderr)]
    assert frames and max(frames) == 0, done.stderr  # accumulators that spill to the stack would halve the speed


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,kv_tile", [(128, 32), (64, 64)])
def test_tensor_core_body_fits_three_threadgroups_an_sm_for_plain_layers(tmp_path, dtype, head_dim, kv_tile):
    """Three 128-thread threadgroups an SM (168 registers or fewer a thread) is what the H200 measured the
    pipelined body at (docs/benchmarks.md, "The O rescale skipped while a row's maximum holds"): the body
    before it took 171 registers, two threadgroups an SM, and 20-30 % longer on long-context chunks."""
    header, body = mma_source.render()
    constants = (head_dim, 16, 8, 4, 4, 16, kv_tile, 128, 0, 0, 0)
    (tmp_path / "k.ptx").write_text(nvrtc_ptx(kernel_text(header, body, dtype, constants)))
    done = subprocess.run([str(PTXAS), "-arch=sm_90", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    assert registers * 128 * 3 <= 65536, done.stderr


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_simt_varlen_body_compiles_for_sm90(tmp_path, dtype):
    header, body = source.render_varlen("cuda")
    (tmp_path / "k.ptx").write_text(nvrtc_ptx(kernel_text(header, body, dtype, (128, 16, 8, 4, 4, 16, 32 if dtype != "float32" else 8, 128, 1, 1, 1))))
    done = subprocess.run([str(PTXAS), "-arch=sm_90", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


#: pointer type of each kernel input and output, by name (orchard/kernels/source.py's lists)
POINTERS = {"queries": "const T*", "key_cache": "const T*", "value_cache": "const T*", "block_tables": "const int*",
            "context_lens": "const int*", "units": "const int*", "split_rows": "const int*", "scale": "const float*",
            "dims": "const int*", "window": "const int*", "sinks": "const float*", "part_out": "float*",
            "part_max": "float*", "part_sum": "float*", "out": "T*", "merged": "T*"}


def named_kernel_text(header: str, body: str, names: list, template: dict, dtype: str) -> str:
    """The kernel as MLX's `cuda_kernel` declares it: the header, then a plain `__global__` function of the
    named inputs and outputs whose template constants are `constexpr` locals (mlx/backend/cuda/custom_kernel.cpp)."""
    t = CUDA_TYPES[dtype]
    params = ", ".join(f"{POINTERS[n].replace('T*', t + '*')} {n}" for n in names)
    constants = "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items())
    return (f"#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n{header}\nnamespace mlx::core::cu {{\n"
            f"__global__ void orchard_kernel({params}) {{\n  using T = {t};\n{constants}\n{body}\n}}\n}}\n")


DECODE_TEMPLATE = dict(HEAD_DIM=128, BLOCK_SIZE=16, NUM_KV_HEADS=8, GROUP=4, HEADS_PER_TILE=4, LANES=16, NUM_THREADS=128, UNROLL=4,
                       TILES_PER_THREADGROUP=1, SOFTCAP=1, WINDOWED=1, SINKS=1)


@pytest.mark.parametrize("kernel", ["decode", "decode_split", "reduce", "varlen_merge"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_and_merge_kernels_with_layer_inputs_compile_for_sm90(tmp_path, kernel, dtype):
    if kernel.startswith("decode"):
        header, body = source.render_decode("cuda", kernel == "decode_split")
        outputs = source.PARTITION_OUTPUTS if kernel == "decode_split" else source.SINGLE_OUTPUTS
        names, template = source.DECODE_INPUTS + outputs, DECODE_TEMPLATE
    elif kernel == "reduce":
        header, body = source.render_reduce("cuda")
        names, template = source.REDUCE_INPUTS + source.REDUCE_OUTPUTS, dict(HEAD_DIM=128, NUM_HEADS=32, NUM_THREADS=128, WINDOWED=1, SINKS=1)
    else:
        header, body = source.render_varlen_merge("cuda")
        names, template = source.VARLEN_MERGE_INPUTS + source.VARLEN_MERGE_OUTPUTS, dict(HEAD_DIM=128, NUM_HEADS=32, NUM_THREADS=128, SINKS=1)
    assert {"sinks"} <= set(names) and ("window" in names) == (kernel != "varlen_merge")
    (tmp_path / "k.ptx").write_text(nvrtc_ptx(named_kernel_text(header, body, names, template, dtype)))
    done = subprocess.run([str(PTXAS), "-arch=sm_90", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("softcap", [0, 1])
def test_decode_kernel_keeps_its_rows_in_registers_unless_the_layer_soft_caps(tmp_path, split, softcap):
    """`tanhf` is a call: with it compiled in, the decode kernel's K/V rows move to a stack frame,
    which ran 5x slower on the H200. Only layers that soft-cap compile it (SOFTCAP=1)."""
    header, body = source.render_decode("cuda", split)
    names = source.DECODE_INPUTS + (source.PARTITION_OUTPUTS if split else source.SINGLE_OUTPUTS)
    template = {**DECODE_TEMPLATE, "SOFTCAP": softcap, "WINDOWED": 0, "SINKS": 0}
    (tmp_path / "k.ptx").write_text(nvrtc_ptx(named_kernel_text(header, body, names, template, "float16")))
    done = subprocess.run([str(PTXAS), "-arch=sm_90", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    frames = [int(n) for n in re.findall(r"(\d+) bytes stack frame", done.stderr)]
    assert frames and (max(frames) == 0) == (softcap == 0), done.stderr


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_the_tensor_core_decode_loops_register_bound_reaches_the_compiled_kernel(tmp_path, split):
    """KernelTuning bounds a single-pass launch's registers so that eight 64-thread threadgroups fit an
    SM's 64K, and leaves a split launch's to the compiler (which takes more): the bound is in the text
    ptxas compiles, declared as MLX declares the kernel."""
    tuning = launch.KernelTuning()
    blocks = tuning.register_blocks(split)
    assert (blocks is None) == split
    header, body = mma_decode_source.render(split, True, tuning.threads, blocks)
    names = source.DECODE_INPUTS + (source.PARTITION_OUTPUTS if split else source.SINGLE_OUTPUTS)
    template = {**DECODE_TEMPLATE, "NUM_THREADS": tuning.threads, "SOFTCAP": 0, "WINDOWED": 0, "SINKS": 0}
    (tmp_path / "k.ptx").write_text(nvrtc_ptx(named_kernel_text(header, body, names, template, "float16")))
    done = subprocess.run([str(PTXAS), "-arch=sm_90", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    registers = int(re.search(r"Used (\d+) registers", done.stderr).group(1))
    fits = registers * tuning.threads * 8 <= 65536
    assert fits != split, done.stderr
