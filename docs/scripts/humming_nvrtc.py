"""Compile a source written by humming_sass.py with NVRTC, as Humming does where ``cuda.bindings.nvrtc`` imports
(its ``NVRTCCompiler``: the same flags and header shims, the kernel instantiated through a name expression), to check
that its SASS is the NVCC path's (round 15, issue #50).

    uv run python docs/scripts/humming_nvrtc.py /tmp/sass/h19/gate_m64/kernel.cu /tmp/sass/h19/gate_m64/nvrtc.cubin
"""

import json
import sys

from cuda.bindings import nvrtc

src_path, out = sys.argv[1], sys.argv[2]
cfg = json.load(open(src_path.replace("kernel.cu", "config.json")))
src = open(src_path).read()
src = src[: src.rfind("\nauto ptr")]  # the NVCC path's instantiation; NVRTC uses the name expression
_STD = "namespace std {\nusing cuda::std::is_same;\nusing cuda::std::conditional_t;\nusing cuda::std::conditional;\n"
_STD += "using cuda::std::enable_if;\nusing cuda::std::enable_if_t;\n}"
SHIMS = {  # humming/jit/compiler.py NVRTCCompiler._STD_HEADER_SHIMS
    "climits": "#include <cuda/std/climits>",
    "cfloat": "#include <cuda/std/cfloat>",
    "cstddef": "#include <cuda/std/cstddef>\nusing namespace cuda::std;",
    "cstdint": "#include <cuda/std/cstdint>\n#include <cuda/std/type_traits>\nusing namespace cuda::std;\n" + _STD,
    "type_traits": "#include <cuda/std/type_traits>\n" + _STD,
    "cuda.h": "#pragma once\n#include <cuda/std/cstdint>\nusing namespace cuda::std;\ntypedef uint64_t cuuint64_t;\n"
    "#define CU_TENSOR_MAP_NUM_QWORDS 16\ntypedef struct CUtensorMap_st {\n alignas(64) cuuint64_t "
    "opaque[CU_TENSOR_MAP_NUM_QWORDS];\n} CUtensorMap;",
}
FLAGS = ["--gpu-architecture=sm_90a", "-std=c++17", "-DHUMMING_DEBUG_KERNEL=0", "--dopt=on",
         "-extra-device-vectorization", "--ptxas-options=-O3", "--ptxas-options=--register-usage-level=10",
         "--diag-suppress=39,161,174,177,940,1444", "-default-device", "-no-cache", "-I/tmp/h19src/humming/include",
         "-I/usr/local/cuda/include", "-I/usr/local/cuda/include/cccl", "-lineinfo"]  # fmt: skip
_, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"kernel.cu", len(SHIMS), [v.encode() for v in SHIMS.values()],
                                   [k.encode() for k in SHIMS])  # fmt: skip
nvrtc.nvrtcAddNameExpression(prog, " ".join(cfg["kernel_expr"].split()).encode())
(res,) = nvrtc.nvrtcCompileProgram(prog, len(FLAGS), [f.encode() for f in FLAGS])
_, n = nvrtc.nvrtcGetProgramLogSize(prog)
log = b" " * n
nvrtc.nvrtcGetProgramLog(prog, log)
print(res, log.decode().strip()[-2000:])
_, n = nvrtc.nvrtcGetCUBINSize(prog)
buf = b" " * n
nvrtc.nvrtcGetCUBIN(prog, buf)
open(out, "wb").write(buf)
print("cubin", n, "bytes, NVRTC", nvrtc.nvrtcVersion()[1:])
