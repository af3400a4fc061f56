"""bench/compile_h200.py: reading ptxas's and XLA's reports, and the stand-in CUDA driver.

The compile itself needs the CUDA PJRT plugin (`make compile-h200` installs it in its own
virtual environment; CI runs it); these tests need only gcc.
"""

import ctypes
import pathlib
import shutil
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import compile_h200  # noqa: E402

# What XLA logged for a program with a Pallas Triton kernel and an XLA fusion (the second
# entry's lines interleaved with another log line, as on stderr).
_PTXAS_LOG = """\
I1130 06:03:12.036609   13225 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'stellarax_attention_fwd' for 'sm_90a'
ptxas info    : Function properties for stellarax_attention_fwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 166 registers, used 1 barriers
ptxas info    : Compile time = 137.999 ms
ptxas info    : Compiling entry function 'loop_add_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_add_fusion
I1130 06:03:12.1 something else
    8 bytes stack frame, 52 bytes spill stores, 48 bytes spill loads
ptxas info    : Used 255 registers, used 16 barriers, 1 bytes smem
"""


def test_parse_ptxas_reads_each_entry_function():
  stats = compile_h200.parse_ptxas(_PTXAS_LOG)
  assert list(stats) == ["stellarax_attention_fwd", "loop_add_fusion"]
  fwd, fusion = stats.values()
  assert (fwd.registers, fwd.barriers, fwd.spills) == (166, 1, False)
  assert (fusion.registers, fusion.barriers, fusion.stack_frame) == (255, 16, 8)
  assert (fusion.spill_stores, fusion.spill_loads, fusion.spills) == (52, 48, True)


def test_parse_ptxas_of_nothing_is_empty():
  assert compile_h200.parse_ptxas("ptxas info    : 0 bytes gmem\n") == {}


def test_parse_thunk_sequence_reads_pallas_launches():
  text = ("001: kCustomKernel [source | sink] stellarax_attention_fwd grid: [16, 64, 2] threads: "
          "[256, 1, 1]  shared_memory: 131072 bytes\n"
          "002: kKernel [source] loop_add_fusion grid: [4, 1, 1] threads: [128, 1, 1]\n")
  assert compile_h200.parse_thunk_sequence(text) == {
      "stellarax_attention_fwd": ((16, 64, 2), 256, 131072)}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the stand-in driver is built with gcc")
def test_stand_in_driver_answers_as_an_h200_and_loads_nothing(tmp_path):
  # A "plugin" naming three driver entry points, as the real one's string table does.
  plugin = tmp_path / "xla_cuda_plugin.so"
  plugin.write_bytes(b"\x00cuInit\x00cuDeviceGetAttribute\x00cuMemAlloc_v2\x00junk\x00")
  library = compile_h200.build_driver_stand_in(plugin, tmp_path / "cache")
  driver = ctypes.CDLL(str(library))
  assert driver.cuInit(0) == 0 and driver.cuMemAlloc_v2() == 0
  value = ctypes.c_int()
  major, minor, sms = 75, 76, 16  # CUdevice_attribute values
  answers = []
  for attribute in (major, minor, sms):
    assert driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, 0) == 0
    answers.append(value.value)
  assert answers == [9, 0, 132]
  # Loading a module fails (CUDA_ERROR_INVALID_IMAGE): nothing compiled here can run.
  assert driver.cuModuleLoadData(ctypes.byref(ctypes.c_void_p()), None) == 200
  # Built once per plugin.
  assert compile_h200.build_driver_stand_in(plugin, tmp_path / "cache") == library


def test_parse_ptxas_attaches_performance_remarks_to_their_kernel():
  text = (
      "ptxas info    : (C7519) warpgroup.arrive is injected in around line 669 by compiler to"
      " allow use of registers in GMMA in function 'ragged_dot_fwd_mosaic_gpu_kernel'\n"
      "ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are"
      " serialized due to the presence of Extern calls in the function 'attention_kernel'.\n"
      "ptxas info    : Compiling entry function 'ragged_dot_fwd_mosaic_gpu_kernel' for 'sm_90a'\n"
      "ptxas info    : Used 168 registers, used 16 barriers\n"
      "ptxas info    : Compiling entry function 'attention_kernel' for 'sm_90a'\n"
      "ptxas info    : Used 168 registers, used 16 barriers\n")
  stats = compile_h200.parse_ptxas(text)
  ragged, attention = stats["ragged_dot_fwd_mosaic_gpu_kernel"], stats["attention_kernel"]
  assert [r.split()[0] for r in ragged.remarks] == ["C7519"] and not ragged.wgmma_serialized
  assert attention.remarks[0].startswith("C7510 Potential Performance Loss") and attention.wgmma_serialized


def test_compile_only_workloads_trace():
  # Each extra workload's program (the gradient of its op call) traces with the op's XLA
  # implementation on the CPU, from the input specs alone.
  import jax
  from stellarax.core import registry
  workloads = compile_h200.more_workloads()
  assert len({w.name for w in workloads}) == len(workloads) == 5
  for w in workloads:
    xla = registry.lookup(f"{w.family}.xla")()
    grads = jax.eval_shape(lambda *a, w=w, xla=xla: w.call(xla, *a), *w.input_specs())
    specs = w.input_specs()
    assert [g.shape for g in grads] == [s.shape for s in specs[:len(grads)]], w.name


def test_ptx_traits_per_entry_function():
  ptx = """
.version 8.8
.target sm_90a
.visible .entry hopper_kernel(
  .param .u64 a
)
{
  cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
  wgmma.fence.sync.aligned;
  wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
}
.visible .entry triton_kernel(
)
{
  ld.global.b32 %r9, [%rd3];
  cp.async.cg.shared.global [ %r5 + 0 ], [ %rd4 + 0 ], 0x10, %r6;
  mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1}, {%r2}, {%f5};
}
.entry copy_kernel()
{
  ld.global.f32 %f1, [%rd1];
  @%p1 ld.global.nc.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];
}
.entry wide_kernel()
{
  @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
}
"""
  T = compile_h200.PtxTraits
  assert compile_h200.ptx_traits(ptx) == {
      "hopper_kernel": T("wgmma", "tma", 0), "triton_kernel": T("mma", "cp.async", 32),
      "copy_kernel": T("none", "none", 64), "wide_kernel": T("none", "none", 128)}


# One thread's PTX in the shapes Mosaic GPU emits: a tile loop ($L__BB0_1) whose
# epilogue stores a tile to shared memory, fences and TMA-stores it, then waits on an
# mbarrier in an inline-asm block with its own labels; wgmma reads shared memory at the
# loop's head. Each test below takes something out.
_PTX_PROXY = """
.visible .entry k(
  .param .u64 a
)
{
  .reg .pred %p<4>;
$L__BB0_1:
  wgmma.fence.sync.aligned;
  { .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1; }
  wgmma.commit_group.sync.aligned;
  wgmma.wait_group.sync.aligned 0;
  @%p1 bra $L__BB0_3;
  st.shared.b32 [%rd4], %r1;
  stmatrix.sync.aligned.m8n8.x4.shared.b16 [%r5], {%r1, %r2, %r3, %r4};
$L__BB0_3:
  fence.proxy.async.shared::cta;
  @%p2 cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%rd5, {%r1, %r2, %r3}], [%r4];
  {
  .reg .pred P1;
  LAB_WAIT:
  mbarrier.try_wait.parity.shared.b64 P1, [%r6], %r7, %r8;
  @P1 bra.uni DONE;
  bra.uni LAB_WAIT;
  DONE:
  }
  @%p3 bra $L__BB0_1;
  ret;
}
"""


def test_async_reads_after_unfenced_shared_stores_are_found():
  count = compile_h200.ptx_unfenced_async_reads
  assert count(_PTX_PROXY) == 0
  assert compile_h200.ptx_traits(_PTX_PROXY)["k"].unfenced_async_reads == 0
  # Without the fence the TMA store reads the stores of one branch, and the next tile's
  # wgmma (round the loop) the stores of the tile before.
  assert count(_PTX_PROXY.replace("fence.proxy.async.shared::cta;", "")) == 2
  # A fence on one branch only: the path that skips it (the stmatrix store's) is unfenced.
  one_path = _PTX_PROXY.replace("  fence.proxy.async.shared::cta;\n", "").replace(
      "  st.shared.b32 [%rd4], %r1;\n", "  st.shared.b32 [%rd4], %r1;\n  fence.proxy.async;\n")
  assert count(one_path) == 2
  assert count(one_path.replace("stmatrix.sync.aligned.m8n8.x4.shared.b16", "mov.b32")) == 0
  # A store after the fence reaches the TMA store.
  late = _PTX_PROXY.replace("  @%p2 cp.async", "  st.shared.b32 [%rd9], %r1;\n  @%p2 cp.async")
  assert count(late) == 2
  # Ampere's cp.async writes through the generic proxy too (Triton fences after it).
  copied = late.replace("st.shared.b32 [%rd9], %r1;",
                        "cp.async.cg.shared.global [ %r5 + 0 ], [ %rd4 + 0 ], 0x10, %r6;")
  assert count(copied) == 2
  assert count("") == 0


def test_an_unfenced_kernel_is_wrong_not_slow():
  k = compile_h200.KernelStats("k", tensor_cores="wgmma", async_copies="tma",
                               unfenced_async_reads=3, spill_stores=8, spill_loads=8)
  assert compile_h200._status(k) == "UNFENCED SMEM, SPILLS"
  k.unfenced_async_reads = 0
  assert compile_h200._status(k) == "SPILLS"


def test_a_kernel_is_slow_for_what_its_ptx_shows():
  def status(**fields):
    k = compile_h200.KernelStats("k", **fields)
    return compile_h200._status(k)
  assert status(tensor_cores="wgmma", async_copies="tma", global_load_bits=0) == "ok"
  assert status(tensor_cores="mma", async_copies="cp.async", global_load_bits=32) == "ok"
  assert status(tensor_cores="none", async_copies="none", global_load_bits=128) == "ok"
  assert status(tensor_cores="wgmma", async_copies="none", global_load_bits=128) == "NOT PIPELINED"
  assert status(tensor_cores="none", async_copies="none", global_load_bits=64) == "NARROW LOADS"
  assert status(tensor_cores="wgmma", async_copies="cp.async", spill_stores=8,
                remarks=["C7515 wgmma.mma_async instructions are serialized due to x"]) == (
                    "SPILLS, WGMMA SERIALIZED")
  assert status() == "ok"  # no PTX seen: nothing to say


@pytest.mark.skipif(shutil.which("sh") is None, reason="the ptxas wrapper is a shell script")
def test_ptxas_wrapper_keeps_the_module_and_runs_the_real_ptxas(tmp_path):
  real = tmp_path / "real"
  (real / "bin").mkdir(parents=True)
  (real / "nvvm").mkdir()
  fake_ptxas = real / "bin" / "ptxas"
  fake_ptxas.write_text('#!/bin/sh\necho "real ptxas $*"\n')
  fake_ptxas.chmod(0o755)
  (real / "bin" / "nvlink").write_text("")
  root = compile_h200._cuda_root_keeping_ptx(real, tmp_path / "work")
  assert (root / "nvvm").resolve() == (real / "nvvm").resolve()
  assert (root / "bin" / "nvlink").resolve() == (real / "bin" / "nvlink").resolve()
  module = tmp_path / "tempfile-123"
  module.write_text(".entry k() {}")
  import subprocess
  out = subprocess.run([str(root / "bin" / "ptxas"), str(module), "-o", str(tmp_path / "x.cubin"),
                        "-arch=sm_90a"], capture_output=True, text=True, check=True).stdout
  assert out.strip() == f"real ptxas {module} -o {tmp_path / 'x.cubin'} -arch=sm_90a"
  kept = list((tmp_path / "work" / "ptx").glob("*.ptx"))
  assert len(kept) == 1 and kept[0].read_text() == ".entry k() {}"


def test_pallas_calls_finds_the_triton_kernels_of_a_program():
  # The table keeps only Pallas kernels, named by the program's Triton custom calls
  # (XLA launches its own fusions as custom kernels too).
  import jax
  import jax.numpy as jnp
  from h200 import H200_MESH
  from jax.sharding import use_abstract_mesh
  from stellarax.ops.normalization import pallas_triton as norms
  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
  scale = jax.ShapeDtypeStruct((256,), jnp.bfloat16)
  tunables = norms.heuristic_tunables(64, 256, jnp.bfloat16)
  program = lambda x, s: norms.rms_norm_fwd_pallas_triton(x, s, **tunables)[0] * 2
  with use_abstract_mesh(H200_MESH):
    lowered = jax.jit(program).trace(x, scale).lower(lowering_platforms=("cuda",))
  triton, mosaic = compile_h200._pallas_calls(lowered)
  assert triton == ["rms_norm_fwd"] and mosaic == []



# nvdisasm -c output of two functions: `k` spills once before its loop, once inside it
# and once after; its mbarrier wait's retry block at the end branches back into the
# body (to the loop's head), which must not make the body a loop. `j` does not spill.
_SASS = """\
//--------------------- .text.k --------------------------
\t.section\t.text.k,"ax",@progbits
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2                  (*"SpillRefill"*);
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_1:
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0040*/                   LDL R3, [R1]                  (*"SpillRefill"*);
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/                   LDL R4, [R1+0x4]              (*"SpillRefill"*);
        /*0065*/                   STL [R1+0x8], R4 ;
        /*0070*/                   EXIT ;
.L_x_9:
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0090*/              @!P0 BRA `(.L_x_9) ;
        /*00a0*/                   BRA `(.L_x_1) ;
.L_x_10:
        /*00b0*/                   BRA `(.L_x_10);
//--------------------- .text.j --------------------------
.text.j:
        /*0000*/                   EXIT ;
//--------------------- SYMBOLS --------------------------
"""


def test_sass_spill_sites_counts_only_spills_inside_natural_loops():
  functions = compile_h200.sass_functions(_SASS)
  assert list(functions) == ["k", "j"]
  # The LDL in the loop; not the spills before and after it, nor the unmarked STL.
  assert compile_h200.sass_spill_sites(functions["k"]) == compile_h200.SpillSites(1, 0, 3)
  assert compile_h200.sass_spill_sites(functions["j"]) == compile_h200.SpillSites(0, 0, 0)
  assert compile_h200.sass_spill_sites("") == compile_h200.SpillSites(0, 0, 0)
  # The same loop without its spill: every spill is outside loops.
  no_loop_spill = functions["k"].replace('LDL R3, [R1]                  (*"SpillRefill"*)',
                                         "IADD3 R3, R3, 0x1, RZ")
  assert compile_h200.sass_spill_sites(no_loop_spill) == compile_h200.SpillSites(0, 0, 2)


# A persistent kernel's shape: a tile loop (.L_x_1) around a contraction loop of wgmma
# (.L_x_2) whose mbarrier wait retries in a block of its own (.L_x_3, a loop too). One
# spill per tile (before the contraction loop), one a step.
_SASS_NESTED = """\
//--------------------- .text.p --------------------------
.text.p:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   STL [R1], R2                  (*"SpillRefill"*);
.L_x_2:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0030*/              @!P0 BRA `(.L_x_3) ;
.L_x_4:
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0050*/                   LDL R3, [R1+0x4]              (*"SpillRefill"*);
        /*0060*/               @P1 BRA `(.L_x_2) ;
        /*0070*/                   LDL R2, [R1]                  (*"SpillRefill"*);
        /*0080*/               @P2 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
.L_x_3:
        /*00a0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*00b0*/              @!P0 BRA `(.L_x_3) ;
        /*00c0*/                   BRA `(.L_x_4) ;
//--------------------- SYMBOLS --------------------------
"""


def test_sass_spill_sites_tells_per_tile_spills_from_per_step_ones():
  p = compile_h200.sass_functions(_SASS_NESTED)["p"]
  # The LDL next to the wgmma is a step's; the STL and LDL around the contraction loop
  # are the tile loop's.
  assert compile_h200.sass_spill_sites(p) == compile_h200.SpillSites(1, 2, 3)
  # Without tensor cores nothing tells a step loop apart: every spill in a loop counts.
  assert (compile_h200.sass_spill_sites(p.replace("HGMMA.64x128x16.F32.BF16", "FFMA"))
          == compile_h200.SpillSites(3, 0, 3))


# A memory warpgroup's shape (the ragged_dot multicast kernel's, 2026-11-30): a tile loop
# (.L_x_1) around a loop of TMA loads (.L_x_2); after it, a wait on a consumed barrier
# whose address was spilled: reloaded before the wait (.L_x_5) and again in the wait's
# retry loop (.L_x_6, reached only while the barrier is not ready).
_SASS_MEMORY = """\
//--------------------- .text.m --------------------------
.text.m:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2                  (*"SpillRefill"*);
.L_x_1:
        /*0020*/                   IADD3 R4, R4, 0x1, RZ ;
.L_x_2:
        /*0030*/                   UTMALDG.4D.MULTICAST [UR32], [UR12], UR15 ;
        /*0040*/                   SYNCS.ARRIVE.TRANS64 RZ, [UR4+0x38020], R16 ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
.L_x_5:
        /*0060*/                   LDL R17, [R1]                 (*"SpillRefill"*);
        /*0070*/                   R2UR UR6, R17 ;
.L_x_7:
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR6], R2 ;
        /*0090*/              @!P2 BRA `(.L_x_6) ;
.L_x_8:
        /*00a0*/               @P3 BRA `(.L_x_1) ;
        /*00b0*/                   EXIT ;
.L_x_6:
        /*00c0*/                   LDL R15, [R1]                 (*"SpillRefill"*);
        /*00d0*/                   R2UR UR6, R15 ;
.L_x_9:
        /*00e0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R15+URZ], R2 ;
        /*00f0*/              @!P2 NANOSLEEP.SYNCS 0x989680 ;
        /*0100*/              @!P2 BRA `(.L_x_6) ;
        /*0110*/                   BRA `(.L_x_8) ;
//--------------------- SYMBOLS --------------------------
"""


def test_sass_spill_sites_counts_memory_warpgroup_and_retry_spills_per_tile():
  m = compile_h200.sass_functions(_SASS_MEMORY)["m"]
  # TMA loads make .L_x_2 a step loop, so both reloads run once per tile: the one in
  # the retry loop counts as the tile loop's, the loop it waits in.
  assert compile_h200.sass_spill_sites(m) == compile_h200.SpillSites(0, 2, 3)
  # Without the loads nothing tells a step loop apart: both reloads count as steps'.
  assert (compile_h200.sass_spill_sites(m.replace("UTMALDG.4D.MULTICAST", "IADD3"))
          == compile_h200.SpillSites(2, 0, 3))
  # A retry loop that does more than wait is a loop of its own: its reload is a step's.
  busy = m.replace("R2UR UR6, R15", "FFMA R3, R3, R3, R3")
  assert compile_h200.sass_spill_sites(busy) == compile_h200.SpillSites(1, 1, 3)


def test_spills_outside_loops_are_not_slow():
  k = compile_h200.KernelStats("k", spill_stores=8, spill_loads=8, tensor_cores="wgmma",
                               async_copies="tma")
  assert compile_h200._status(k) == "SPILLS"  # Not located: counted.
  k.spills_in_loops = 2
  assert compile_h200._status(k) == "SPILLS"
  k.spills_in_loops = 0
  assert compile_h200._status(k) == "ok"
  k.spills_in_outer_loops = 2  # Once per tile of a persistent kernel: not slow either.
  assert compile_h200._status(k) == "ok"


def test_printed_ptx_is_the_module_without_the_ptxas_report():
  printed = ("mosaic resources ...\n//\n// Generated by LLVM NVPTX Back-End\n//\n\n.version 9.0\n"
             ".visible .entry k()\n{\n\tret;\n}\n"
             "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n")
  ptx = compile_h200._printed_ptx(printed)
  assert ptx.startswith("//\n// Generated by LLVM NVPTX") and ptx.endswith("}\n")
  assert compile_h200._printed_ptx("no module here") == ""


def test_verdict_blocks_slow_defaults_at_targets_and_serialized_wgmma_anywhere():
  row = lambda **kw: compile_h200.Row(workload="w", op="op", config="c", **kw)
  fine = [row(heuristic=True), row(status="SPILLS"), row(pallas=False, status="SPILLS"),
          row(status="not supported: float64")]
  verdict = compile_h200.Verdict.of(fine)
  assert verdict.passed and len(verdict.slow) == 1 and not verdict.slow_defaults
  assert "4 kernels compiled" in verdict.summary() and "1 slow" in verdict.summary()
  # Off the speed targets a heuristic config's spills are reported, not failed on...
  spills = compile_h200.Verdict.of(fine + [row(heuristic=True, target=False, status="SPILLS")])
  assert spills.passed and len(spills.slow_defaults) == 1 and not spills.blocking
  # ... its serialized wgmma fail, and at a target any slowness does.
  for status, target in (("WGMMA SERIALIZED", False), ("SPILLS, WGMMA SERIALIZED", False),
                         ("SPILLS", True), ("NARROW LOADS", True)):
    verdict = compile_h200.Verdict.of(fine + [row(heuristic=True, target=target, status=status)])
    assert not verdict.passed and len(verdict.blocking) == 1, status
    assert "1 failing the check" in verdict.summary()
  for status in ("compile error: boom", "UNFENCED SMEM (2 async reads)"):
    assert not compile_h200.Verdict.of(fine + [row(status=status)]).passed
  # On a jax newer than the pin, spills at a target are reported; the rest still fails.
  for status, fails in (("SPILLS", False), ("SPILLS, NARROW LOADS", True), ("NARROW LOADS", True),
                        ("WGMMA SERIALIZED", True)):
    verdict = compile_h200.Verdict.of(fine + [row(heuristic=True, target=True, status=status)],
                                      spills_block=False)
    assert verdict.passed is not fails and len(verdict.slow_defaults) == 1, status
  assert not compile_h200.Verdict.of(fine + [row(status="compile error: boom")], spills_block=False).passed


# A stand-in worker: writes the rows of its share (items i, i + n, ...) of six configs,
# each as its own kernel, and fails when told to.
_FAKE_WORKER = """
import json, sys, pathlib
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--out") + 1])
i, n = map(int, args[args.index("--worker") + 1].split("/"))
if "--fail" in args and i == 1:
  print("worker 1 broke"); sys.exit(3)
out.mkdir(parents=True)
rows = [dict(workload="w", op="op", config=f"c{k}", kernel=f"k{k}", grid=[k, 1], item=k)
        for k in range(i, 6, n)]
out.joinpath("kernels.json").write_text(json.dumps(rows))
"""


def test_workers_share_the_configs_and_their_rows_come_back_in_order(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_FAKE_WORKER)
  rows = compile_h200.run_in_workers([], tmp_path / "out", 4, script=script)
  assert [r.item for r in rows] == list(range(6))
  assert [r.kernel for r in rows] == [f"k{k}" for k in range(6)]
  assert rows[2].grid == (2, 1)  # a tuple again, as a Row of this process has it
  with pytest.raises(SystemExit, match=r"worker 1/2 exited with 3:\n.*worker 1 broke"):
    compile_h200.run_in_workers(["--fail"], tmp_path / "failing", 2, script=script)


def test_worker_spec_is_a_share_of_a_run():
  assert compile_h200._worker_spec("1/3") == (1, 3)
  for bad in ("3/3", "1", "a/2", "-1/2"):
    with pytest.raises(Exception, match="--worker takes i/n"):
      compile_h200._worker_spec(bad)
