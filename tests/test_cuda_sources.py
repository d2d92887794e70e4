"""Every CUDA kernel the extension JITs compiles for sm_90 (Hopper), checked with nvcc here.

The kernels are wrapped exactly as mlx::core::fast::cuda_kernel wraps them (inputs as
`const T* name`, outputs as `T* name`, template args as constexpr / using lines before the body).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from voicechat.kernels import ext

STUB = Path(__file__).parent / "data" / "cuda_stub"
MLX_PRELUDE = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""


def kernel(src: dict, inst: dict, name: str, launch_bounds: bool = False) -> str:
    """One instance as MLX writes its kernel, under `name`; `launch_bounds`: with the block size our
    own launch states (`__launch_bounds__`, where the source names its threads arg)."""
    params = [f"    const {t}* {n}" for t, n in zip(inst["input_types"], src["input_names"])]
    params += [f"    {t}* {n}" for t, n in zip(inst["output_types"], src["output_names"])]
    consts, bounds = [], ""
    for arg, value in inst["template_args"]:
        kind, _, v = value.partition(":")
        consts.append({"int": f"  constexpr int {arg} = {v};", "bool": f"  constexpr bool {arg} = {v};",
                       "type": f"  using {arg} = {v};"}[kind])
        if launch_bounds and arg == src["threads_arg"]:
            bounds = f"__launch_bounds__({int(v) * src['threads_scale']}) "
    return (f"__global__ void {bounds}{name}(\n" + ",\n".join(params) + ") {\n"
            + "\n".join(consts) + "\n" + src["source"] + "\n}\n\n")


def wrap(src: dict, instances: list[dict]) -> str:
    """The source's instances in one translation unit (the prelude and header once), kernel k named
    custom_kernel_<name>_<k>."""
    return (MLX_PRELUDE + src["header"] + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + "".join(kernel(src, inst, f"custom_kernel_{src['name']}_{k}") for k, inst in enumerate(instances))
            + "} // namespace mlx::core::cu\n")


SOURCES = ext.cuda_sources()
KERNELS = Path(__file__).parents[1] / "csrc" / "kernels"


def test_the_library_embeds_the_kernel_files_byte_for_byte():
    """The CUDA texts are the files of csrc/kernels, embedded at build time as they are: what this nvcc
    check, the CPU emulation and a GPU's compiles get."""
    on_disk = {p.relative_to(KERNELS).as_posix(): p.read_text() for p in KERNELS.rglob("*.cuh")}
    assert on_disk, "no kernel files"
    assert ext.kernel_files() == on_disk


def test_a_kernel_body_is_the_file_named_after_it():
    """A registered kernel's body is the compacted text of <folder>/<name>.body.cuh (decode attention's
    two parts are pieces of that folder put together)."""
    bodies = {Path(path).name: text for path, text in ext.kernel_files().items() if path.endswith(".body.cuh")}
    named = [src for src in SOURCES if f"{src['name']}.body.cuh" in bodies]
    assert {src["name"] for src in SOURCES} - {src["name"] for src in named} == {
        "vc_decode_attn_part", "vc_decode_attn_qkv_part"}
    for src in named:
        assert src["source"] == ext.compact_kernel_text(bodies[f"{src['name']}.body.cuh"]), src["name"]


def test_template_args_make_a_valid_kernel_name():
    """MLX names a compiled kernel after its template args (a '-' of a negative int there does not
    compile under NVRTC, which the nvcc check below, with its own names, cannot see): every int
    argument of every registered instance is >= 0, so floats go in as magnitude bits and a sign."""
    for src in SOURCES:
        for inst in src["instances"]:
            for name, value in inst["template_args"]:
                if value.startswith("int:"):
                    assert int(value[4:]) >= 0, f"{src['name']}: template arg {name} = {value} is negative"


def test_every_cuda_source_has_an_instance():
    assert SOURCES, "no CUDA kernels registered"
    for src in SOURCES:
        assert src["instances"], f"{src['name']}: register at least one instance for the compile check"


def test_a_kernel_of_clusters_keeps_its_shared_data_in_dynamic_shared_memory():
    """The CPU emulation runs a cluster's blocks at once and makes a `__shared__` variable a function
    static: in a kernel of clusters its blocks would share one, and the emulated tests would check
    something the GPU does not run. So such a kernel declares none (its dynamic shared memory is
    each block's own there)."""
    clustered = [src for src in SOURCES if src["cluster"] > 1]
    assert clustered, "no kernel of clusters registered (vc_rvq_cluster)"
    for src in clustered:
        for text in (src["header"], src["source"]):
            for line in text.splitlines():
                assert "__shared__" not in line or "extern __shared__" in line, f"{src['name']}: {line}"
        for inst in src["instances"]:
            assert dict(inst["template_args"]).get("CB") == f"int:{src['cluster']}", (src["name"], inst)


# One nvcc process a source, all its instances in it: several times faster than one a kernel on a
# 2-core machine, and nvcc's message names the failing kernel.
@pytest.mark.parametrize("src", SOURCES, ids=[s["name"] for s in SOURCES])
def test_cuda_source_compiles_for_sm90(src, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    cu = tmp_path / f"{src['name']}.cu"
    cu.write_text(wrap(src, src["instances"]))
    proc = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-I", str(STUB), "-cubin", "-o",
                           str(tmp_path / "out.cubin"), str(cu)], capture_output=True, text=True)
    assert proc.returncode == 0, f"{src['name']} does not compile:\n{proc.stderr}"
    assert "warning" not in proc.stderr.lower(), proc.stderr
    cubin = (tmp_path / "out.cubin").read_bytes()
    for k in range(len(src["instances"])):  # every instance made a kernel (its mangled name in the cubin)
        ident = f"custom_kernel_{src['name']}_{k}"
        assert f"{len(ident)}{ident}E".encode() in cubin, f"{src['name']}: instance {k} made no kernel"


def _fnv1a_name(src: dict) -> str:
    h = 1469598103934665603
    for text in [src["header"], src["source"], *src["input_names"], *src["output_names"]]:
        for byte in text.encode() + b"\0":
            h = ((h ^ byte) * 1099511628211) % (1 << 64)
    return f"{src['name']}_{h:016x}"[: len(src["name"]) + 13]


def test_kernels_compile_under_a_name_that_hashes_their_source():
    """MLX's on-disk kernel cache is keyed by name (and template args): an edited kernel gets a new name."""
    sources = ext.cuda_sources()
    assert len({s["jit_name"] for s in sources}) == len(sources)
    for src in sources:
        assert src["jit_name"] == _fnv1a_name(src)
        edited = dict(src, source=src["source"] + " ")
        assert _fnv1a_name(edited) != src["jit_name"]


def test_the_kernel_cache_is_persistent_unless_set(tmp_path):
    import os
    import subprocess
    import sys

    probe = "import os, voicechat; print(os.environ['MLX_PTX_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "XDG_CACHE_HOME": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith(str(tmp_path / "voicechat" / "mlx-")) and out.endswith("ptx")
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "MLX_PTX_CACHE_DIR": "/x/y"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "/x/y"


def test_kernel_texts_are_kept_beside_the_kernel_cache_unless_set(tmp_path):
    import os
    import sys

    probe = "import voicechat; from voicechat.kernels import ext; print(ext.kernel_text_folder())"
    env = {k: v for k, v in os.environ.items() if k != "VOICECHAT_KERNEL_TEXT_DIR"}
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "XDG_CACHE_HOME": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(tmp_path / "voicechat" / "kernel-text")
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "VOICECHAT_KERNEL_TEXT_DIR": ""},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_compact_kernel_text_drops_comments_and_indentation_only():
    """What register_cuda_source keeps of a kernel's text (MLX-CUDA spends host time on the whole text
    at every launch): no comments, indentation or empty lines; literals as they are (a '//' or an
    apostrophe inside one is no comment), a macro's continued lines whole, a '//' comment continued by
    a trailing backslash gone with its next line, as the preprocessor splices it."""
    text = ('  a = "//x \\" y"; // c\n\n'
            "  b = '/'; c = '\\''; /* d\n  e */ f;\n"
            "#define M(x) x \\\n\n"
            "  y\n"
            "// z \\\n  w\n"
            "\tq;   \n")
    assert ext.compact_kernel_text(text) == ('a = "//x \\" y";\n'
                                             "b = '/'; c = '\\'';   f;\n"
                                             "#define M(x) x \\\n\n"
                                             "y\n"
                                             "q;\n")
    with pytest.raises(ValueError, match="unterminated"):
        ext.compact_kernel_text("a /* b")
    with pytest.raises(ValueError, match="unterminated"):
        ext.compact_kernel_text('a = "b\n";')


def test_compact_kernel_text_keeps_the_preprocessors_tokens(tmp_path):
    """The compacted text is the same token stream as the text with its comments removed by the C
    preprocessor (gcc -fpreprocessed), on this file's own kernel-like sample."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    sample = ("#ifndef G\n#define G\n// a helper, with a 'quote' in its comment\n"
              "template <int N>  /* N: the width */\n__device__ float f(const float* p) {\n"
              "  float s = 0.0f;  // the sum\n#pragma unroll\n  for (int i = 0; i < N; ++i) s += p[i];\n"
              '  static_assert(N > 0, "a block\'s // width");\n  return s;\n}\n#endif\n')

    def tokens(text: str) -> list[str]:
        src = tmp_path / "t.c"
        src.write_text(text)
        out = subprocess.run([gcc, "-fpreprocessed", "-dD", "-E", "-P", "-x", "c", str(src)],
                             capture_output=True, text=True, check=True).stdout
        return out.split()

    compact = ext.compact_kernel_text(sample)
    assert "//" not in compact.replace('"a block\'s // width"', "")
    assert tokens(compact) == tokens(sample)


def test_registered_kernels_are_compact_and_carry_only_their_parts():
    for src in SOURCES:
        for part in ("header", "source"):
            assert ext.compact_kernel_text(src[part]) == src[part], f"{src['name']}: {part} not compacted"
    by_name = {s["name"]: s["header"] for s in SOURCES}
    for name in ("vc_dense_mv", "vc_dense_add_norm"):
        assert "dense_accumulate" in by_name[name] and "qmv_accumulate" not in by_name[name], name
    for name in ("vc_qmv", "vc_qmv_emit"):
        assert "qmv_accumulate" in by_name[name] and "dense_accumulate" not in by_name[name], name
    for name in ("vc_qmv_stream", "vc_qmv_imma_stream", "vc_two_head_argmax_stream"):
        assert "qmv_accumulate" not in by_name[name] and "dense_accumulate" not in by_name[name], name


def test_kernels_reach_mlx_as_include_lines_of_their_registered_text(tmp_path):
    """MLX-CUDA hashes a kernel's whole text at every launch: each kernel is handed over as two short
    #include lines of files that hold exactly its registered header and body, named by its jit name."""
    for src in SOURCES:
        header, body, included = ext.launch_text(src, str(tmp_path))
        assert included, src["name"]
        assert header == f'#include "{tmp_path}/{src["jit_name"]}.cuh"\n'
        assert body == f'#include "{tmp_path}/{src["jit_name"]}.body.cuh"\n'
        assert (tmp_path / f"{src['jit_name']}.cuh").read_text() == src["header"]
        assert (tmp_path / f"{src['jit_name']}.body.cuh").read_text() == src["source"]


def test_included_texts_are_rewritten_when_a_file_differs(tmp_path):
    src = SOURCES[0]
    ext.launch_text(src, str(tmp_path))
    kept = tmp_path / f"{src['jit_name']}.cuh"
    kept.write_text("garbage")  # a torn or edited file
    ext.launch_text(src, str(tmp_path))
    assert kept.read_text() == src["header"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, f"{src['jit_name']}.body.cuh"])


def test_texts_go_inline_where_no_folder_serves(tmp_path, monkeypatch):
    src = SOURCES[0]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for folder in ("", str(blocked / "sub"), str(tmp_path / 'a"quote')):
        assert ext.launch_text(src, folder) == (src["header"], src["source"], False), folder
    (tmp_path / "held" / f"{src['jit_name']}.cuh").mkdir(parents=True)  # a file that cannot be replaced
    assert ext.launch_text(src, str(tmp_path / "held")) == (src["header"], src["source"], False)
    assert [p.name for p in (tmp_path / "held").iterdir()] == [f"{src['jit_name']}.cuh"]  # no scratch left
    monkeypatch.chdir(tmp_path)  # a relative folder: NVRTC would resolve it from its own cwd
    header, _, included = ext.launch_text(src, "rel")
    assert included and header == f'#include "{tmp_path}/rel/{src["jit_name"]}.cuh"\n'


def test_an_included_body_still_names_the_shapes_it_reads(tmp_path):
    """MLX passes an input's shape / strides / ndim only where the body it sees names them."""
    qmv = next(s for s in SOURCES if s["name"] == "vc_qmv")  # inputs x, weight, ...
    src = dict(qmv, source="int n = x_shape[0] + weight_ndim + out_shape;\n")
    _, body, included = ext.launch_text(src, str(tmp_path))
    assert included and body.splitlines()[1] == "// x_shape weight_ndim"


@pytest.mark.parametrize("name", ["vc_qmv", "vc_dense_mv", "vc_mamba_conv_scan_step", "vc_qmv_stream"])
def test_the_included_form_compiles_to_the_same_ptx(name, tmp_path):
    """What MLX compiles from the include lines is what it compiled from the texts (nvcc's PTX equal)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = next(s for s in SOURCES if s["name"] == name)
    header, body, _ = ext.launch_text(src, str(tmp_path / "text"))
    ptx = []
    for form, text in (("inline", src), ("included", dict(src, header=header, source=body))):
        cu = tmp_path / f"{form}.cu"
        cu.write_text(wrap(text, src["instances"][:1]))
        subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-I", str(STUB), "-ptx", "-o", str(tmp_path / f"{form}.ptx"),
                        str(cu)], check=True, capture_output=True)
        ptx.append((tmp_path / f"{form}.ptx").read_text())
    assert ".entry" in ptx[0] and ptx[0] == ptx[1]


_RUN_ONE_KERNEL = """
import json, sys
import mlx.core as mx
from voicechat.kernels.gemv import on_cuda_gpu, quantized_matvec
if not on_cuda_gpu():
    print(json.dumps(None)); sys.exit()
mx.random.seed(3)
w = mx.random.normal((300, 640)) * 0.05
wq, s, b = mx.quantize(w, group_size=64, bits=4)
x = mx.random.normal((1, 640))
print(json.dumps(quantized_matvec(x, wq, s, b).tolist()))
"""


def test_a_kernel_gives_the_same_result_included_or_inline(tmp_path):
    """On a CUDA GPU (elsewhere the CPU path runs and this skips): in fresh processes, a kernel
    handed to MLX as include lines writes its texts to the folder and gives exactly what the inline
    texts give. Through MLX's launch (VOICECHAT_OWN_LAUNCH=0, the fallback where ours cannot run):
    our own launch, the default, compiles the whole text itself and writes no text files."""
    import json
    import os
    import sys

    def run(folder: str):
        env = {**os.environ, "VOICECHAT_KERNEL_TEXT_DIR": folder, "MLX_PTX_CACHE_DIR": str(tmp_path / "ptx"),
               "VOICECHAT_OWN_LAUNCH": "0"}
        out = subprocess.run([sys.executable, "-c", _RUN_ONE_KERNEL], env=env, capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out)

    included = run(str(tmp_path / "text"))
    if included is None:
        pytest.skip("no CUDA GPU")
    qmv = next(s for s in SOURCES if s["name"] == "vc_qmv")
    assert (tmp_path / "text" / f"{qmv['jit_name']}.body.cuh").read_text() == qmv["source"]
    assert run("") == included
